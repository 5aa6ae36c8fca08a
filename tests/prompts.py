"""Seeded, left-padded prompt batches and the GPT-2 configurations shared by the tests and benchmarks."""

from __future__ import annotations

import torch


def left_padded(vocab: int, lengths, device="cpu", seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``len(lengths)`` prompts of those lengths, left padded with token 0 to the longest, and
    their attention mask (0 on the padding). Token ids are drawn from [2, vocab)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), n), generator=g)
    mask = torch.zeros_like(ids)
    for i, length in enumerate(lengths):
        mask[i, n - length:] = 1
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


# GPT-2 configurations of the tests (transformers GPT2Config keyword arguments), defined once.
TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=0, eos_token_id=1)
# Random init at GPT-2's initializer_range (0.02) makes greedy decoding repeat 1-3 tokens, so a
# broken decode still matches token for token; at 0.5 the continuations vary (40+ distinct tokens
# in 64 steps) and a token comparison means something.
VARIED = dict(TINY, initializer_range=0.5)
SMALL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)  # GPT-2 small's shape
