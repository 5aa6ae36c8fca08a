"""Seeded, left-padded prompt batches shared by the GPT-2 tests."""

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
