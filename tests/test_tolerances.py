"""The tolerances themselves: what they must let through and what they must not."""

from __future__ import annotations

import pytest
import torch

from tests.rowref import softmax_rows
from tests.tolerances import DTYPES_TESTED, assert_close, softmax_tolerance


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
