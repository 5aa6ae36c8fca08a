"""sample: the tokens drawn for given (seed, offset, row, temperature, top_k) on the CPU, pinned as
literal values and checked against Philox4x32-10 written out here from its published definition
(Salmon et al., SC 2011; the known-answer vectors of Random123's kat_vectors), independent of
``fused_attn.reference``'s generator, which the CPU path runs; and out / advance / history at
non-default values."""

from __future__ import annotations

import math

import pytest
import torch

from fused_attn import sample

MASK = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    """Ten rounds; each round after the first bumps the key by the Weyl constants first."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
    return [c0, c1, c2, c3]


def plain_sample(logits, temperature, seed, offsets, top_k=0):
    """The documented draw, in Python floats: argmax over the kept columns of logit / temperature + G,
    G = -log(-log U), U = (top 23 bits + 0.5) / 2**23 of word ``col % 4`` of Philox at counter
    (col // 4, row, offset low, offset high) and key (seed low, seed high)."""
    tokens = []
    for r, row in enumerate(logits):
        kth = sorted(row, reverse=True)[top_k - 1] if 0 < top_k < len(row) else -math.inf
        off = offsets[r]
        scores = []
        for col, logit in enumerate(row):
            word = philox4x32_10([col >> 2, r, off & MASK, off >> 32], [seed & MASK, seed >> 32])[col & 3]
            u = ((word >> 9) + 0.5) * 2.0 ** -23
            scores.append((logit / temperature if logit >= kth else -math.inf) - math.log(-math.log(u)))
        tokens.append(max(range(len(row)), key=scores.__getitem__))
    return tokens


@pytest.mark.parametrize("ctr, key, words", [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([MASK] * 4, [MASK, MASK], [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
])
def test_plain_philox_matches_the_published_vectors(ctr, key, words):
    assert philox4x32_10(ctr, key) == words


VOCAB = 11
# Equal logits: the token is the argmax of the noise alone, so each draw depends on every bit of the
# counter layout, the word picked per column and the key.
UNIFORM_DRAWS = [  # (seed, offset, tokens of rows 0..2)
    (0, 0, [4, 6, 6]),
    (1, 0, [1, 4, 4]),
    (0, 1, [1, 5, 10]),
    (2**40 + 3, 2**33 + 5, [6, 5, 8]),  # high words of the key and of the counter
]


@pytest.mark.parametrize("seed, offset, tokens", UNIFORM_DRAWS)
def test_uniform_draws_are_pinned(seed, offset, tokens):
    logits = torch.zeros(3, VOCAB, dtype=torch.float64)
    assert plain_sample(logits.tolist(), 1.0, seed, [offset] * 3) == tokens
    assert sample(logits, 1.0, seed=seed, offset=offset).tolist() == tokens
    assert sample(logits.float(), 1.0, seed=seed, offset=torch.tensor([offset])).tolist() == tokens


def _logits():
    return torch.linspace(-2, 2, 3 * VOCAB, dtype=torch.float64).view(3, VOCAB).sin() * 3


DRAWS = [  # (temperature, top_k, per-row offsets, tokens)
    (0.5, 0, [0, 7, 9], [7, 10, 9]),
    (2.0, 0, [0, 7, 9], [7, 3, 9]),
    (1.0, 3, [4, 4, 4], [10, 9, 7]),
    (1.0, 0, [5, 6, 7], [9, 9, 5]),
]


@pytest.mark.parametrize("temperature, top_k, offsets, tokens", DRAWS)
def test_temperature_top_k_and_row_offsets_are_pinned(temperature, top_k, offsets, tokens):
    logits = _logits()
    assert plain_sample(logits.tolist(), temperature, 7, offsets, top_k) == tokens
    got = sample(logits, temperature, top_k=top_k, seed=7, offset=torch.tensor(offsets))
    assert got.tolist() == tokens


def test_greedy_ignores_seed_and_top_k():
    logits = _logits()
    assert sample(logits, 0.0, top_k=2, seed=5, offset=3).tolist() == logits.argmax(-1).tolist()


def test_out_advance_and_history_with_offsets_from_the_counters():
    """A decode loop's state: advance row 0 is the offset, row 1 the history index. The token is the
    pinned draw at the pre-advance offset, written to out and at the pre-advance history column."""
    logits = _logits()
    counters = torch.tensor([[5, 6, 7], [0, 2, 1]], dtype=torch.int64)
    history = torch.full((3, 4), -7, dtype=torch.int64)
    out = torch.full((3,), -7, dtype=torch.int64)
    got = sample(logits, 1.0, seed=7, offset=counters[0], out=out, advance=counters, history=history,
                 history_index=counters[1])
    assert got is out
    assert out.tolist() == [9, 9, 5]
    assert counters.tolist() == [[6, 7, 8], [1, 3, 2]]
    assert history.tolist() == [[9, -7, -7, -7], [-7, -7, 9, -7], [-7, 5, -7, -7]]
    # The next step reads the advanced counters: the next offsets' draw.
    sample(logits, 1.0, seed=7, offset=counters[0], out=out, advance=counters, history=history,
           history_index=counters[1])
    assert out.tolist() == plain_sample(logits.tolist(), 1.0, 7, [6, 7, 8])
    assert [history[0, 1].item(), history[1, 3].item(), history[2, 2].item()] == out.tolist()
