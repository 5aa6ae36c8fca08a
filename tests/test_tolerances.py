"""The tolerances themselves: what they must let through and what they must not."""

from __future__ import annotations

import pytest
import torch

from tests.rowref import softmax_rows
from tests.tolerances import DTYPES_TESTED, assert_attention_close, assert_close, softmax_tolerance


def peaked_rows(magnitude: float, gaps) -> torch.Tensor:
    """float64 scores around ``magnitude``: rows of 33 keys, one on top and 32 about ``gap`` below it
    (top probability 0.38 at gap 3, 0.82 at 5, 0.99 at 8, 1 - 3e-12 at 30)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for gap in gaps:
        s = magnitude - gap + 0.1 * torch.randn(33, generator=g, dtype=torch.float64)
        s[7] = magnitude
        rows.append(s)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES_TESTED)
@pytest.mark.parametrize("magnitude", [1.0, 1e3, 1e5])
def test_one_percent_error_fails_on_near_one_hot_rows(magnitude, dtype):
    """A 1% error in every probability of a row whose top probability is >= 0.99 must fail, however
    large the scores (the old score-magnitude term allowed 8 * 2**-24 * |s| relative: 5% at
    |s| = 1e5); below |s| = 1e3, on any row with a dominant entry."""
    scores = peaked_rows(magnitude, (8.0, 12.0, 30.0) if magnitude > 1e3 else (3.0, 5.0, 8.0, 30.0))
    want = softmax_rows(scores)
    tol = softmax_tolerance(want, scores, dtype)
    for factor in (1.01, 0.99):
        with pytest.raises(AssertionError, match="out of tolerance"):
            assert_close(want * factor, want, tol)


@pytest.mark.parametrize("magnitude", [1.0, 1e3, 1e5])
def test_float32_score_rounding_passes(magnitude):
    """What float32 scores legitimately cost: each score rounded to float32 before the softmax."""
    scores = peaked_rows(magnitude, (0.0, 3.0, 5.0, 8.0, 30.0))
    want = softmax_rows(scores)
    rounded = softmax_rows(scores.float().double())
    assert_close(rounded, want, softmax_tolerance(want, scores, torch.float32))


def attention_case(dtype, seed=0):
    """(q, k, v, lengths) of a small decode batch with one sequence that sees no key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, 2, 32, generator=g).to(dtype)
    k = torch.randn(3, 2, 50, 32, generator=g).to(dtype)
    v = torch.randn(3, 2, 50, 32, generator=g).to(dtype)
    return q, k, v, torch.tensor([50, 0, 17], dtype=torch.int32)


def attention_check_args(dtype, seed=0):
    """(float32-accumulated output, PyTorch's peer at dtype, float64 reference, magnitude, max |score|)."""
    from fused_attn import reference
    from tests.test_decode_attention import peer_attention

    q, k, v, lens = attention_case(dtype, seed)
    ours = reference.decode_attention(q, k, v, lens, compute_dtype=torch.float32)[0]
    peer = peer_attention(q, k, v, lens, None, False, None)
    want = reference.decode_attention(q.double(), k.double(), v.double(), lens)[0]
    magnitude = reference.decode_attention(q.double(), k.double(), v.double().abs(), lens)[0]
    score_max = torch.full(want.shape[:-1], 4.0, dtype=torch.float64)
    return ours, peer, want, magnitude, score_max


@pytest.mark.parametrize("dtype", DTYPES_TESTED)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_float32_accumulation_passes(dtype, seed):
    assert_attention_close(*attention_check_args(dtype, seed))


@pytest.mark.parametrize("dtype", DTYPES_TESTED)
def test_attention_errors_fail(dtype):
    ours, peer, want, magnitude, score_max = attention_check_args(dtype)
    one_row = ours.clone()
    factor = {torch.float32: 1.001, torch.float16: 1.01, torch.bfloat16: 1.05}[dtype]  # > 2 x the peer's error
    one_row[2, 1, 0] = (one_row[2, 1, 0].double() * factor).to(dtype)  # on one query row of one sequence
    with pytest.raises(AssertionError, match=r"1 of 24 rows out of tolerance"):
        assert_attention_close(one_row, peer, want, magnitude, score_max)
    no_key = ours.clone()
    no_key[1, 0, 0, 0] = torch.finfo(dtype).tiny  # the sequence with no key: exact zeros only
    with pytest.raises(AssertionError, match=r"out of tolerance"):
        assert_attention_close(no_key, peer, want, magnitude, score_max)
    nan = ours.clone()
    nan[0, 3, 1, 5] = float("nan")
    with pytest.raises(AssertionError, match=r"1 NaN outputs where the reference is finite"):
        assert_attention_close(nan, peer, want, magnitude, score_max)
    # a peer that lost everything does not make the check vacuous: 10% errors fail at the cap
    with pytest.raises(AssertionError, match=r"out of tolerance"):
        assert_attention_close((ours.double() * 1.1).to(dtype), torch.zeros_like(peer), want, magnitude, score_max)
