"""fused_attn.gpt2 at non-default values: a checkpoint whose ``layer_norm_epsilon`` is not 1e-5, every
LayerNorm and every bias its own values (so that swapping two norms, or dropping a bias, changes the
logits), each module backend, and generating exactly up to ``n_positions``; checked against the
Hugging Face GPT-2 model's logits and generate()."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from fused_attn.gpt2 import GPT2  # noqa: E402
from tests.prompts import VARIED, left_padded  # noqa: E402

EPS = 0.1  # comparable to the hidden states' variance: a model that normalizes with 1e-5 is far off
N_POSITIONS = 40


def varied_model(eps=EPS, seed=0):
    """VARIED GPT-2 with ``layer_norm_epsilon=eps``, every LayerNorm weight and bias and every linear
    bias drawn (a fresh model's are ones and zeros, identical everywhere)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = GPT2LMHeadModel(GPT2Config(**dict(VARIED, layer_norm_epsilon=eps, n_positions=N_POSITIONS))).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "ln_" in name:  # LayerNorm weights
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return hf


BACKENDS = {
    "eager": {},
    "fused": {"attention": "fused", "layer_norm": "fused", "linear": "fused", "mlp": "fused", "embed": "fused"},
    "folded": {"attention": "fused", "layer_norm": "folded", "linear": "fused", "mlp": "fused"},
    "sdpa": {"attention": "sdpa"},
}


def _hf_logits(hf, ids, mask):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_logits_of_a_varied_checkpoint_match_hf_cpu(backend):
    hf = varied_model()
    ids, mask = left_padded(VARIED["vocab_size"], (12, 7, 3))
    m = GPT2.from_hf(hf, backends=BACKENDS[backend])
    assert m.config.eps == EPS
    with torch.no_grad():
        got = m(ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], _hf_logits(hf, ids, mask)[keep], rtol=1e-4, atol=1e-4)


def test_the_eps_and_the_varied_weights_matter():
    """The model above is a meaningful check: with eps 1e-5 or with ln_1 and ln_2 swapped, HF's own
    logits move by far more than the tolerance."""
    hf = varied_model()
    ids, mask = left_padded(VARIED["vocab_size"], (12, 7, 3))
    keep = mask.bool()
    base = _hf_logits(hf, ids, mask)[keep]
    other = _hf_logits(varied_model(eps=1e-5), ids, mask)[keep]
    assert (base - other).abs().max() > 1e-2
    swapped = varied_model()
    with torch.no_grad():
        for blk in swapped.transformer.h:
            w1, b1 = blk.ln_1.weight.clone(), blk.ln_1.bias.clone()
            blk.ln_1.weight.copy_(blk.ln_2.weight)
            blk.ln_1.bias.copy_(blk.ln_2.bias)
            blk.ln_2.weight.copy_(w1)
            blk.ln_2.bias.copy_(b1)
    assert (base - _hf_logits(swapped, ids, mask)[keep]).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ["eager", "fused", "folded"])
def test_greedy_decode_of_a_varied_checkpoint_matches_hf_generate_cpu(backend):
    hf = varied_model()
    ids, mask = left_padded(VARIED["vocab_size"], (12, 7, 3))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    got = GPT2.from_hf(hf, backends=BACKENDS[backend]).generate(ids, mask, max_new_tokens=10)
    assert torch.equal(got, want)


def test_generates_exactly_up_to_n_positions_cpu():
    hf = varied_model()
    ids, mask = left_padded(VARIED["vocab_size"], (12, 9))
    m = GPT2.from_hf(hf)
    room = N_POSITIONS - ids.shape[1]
    got = m.generate(ids, mask, max_new_tokens=room)
    assert got.shape == (2, N_POSITIONS)
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=room, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=rf"prompt length \+ max_new_tokens must be <= n_positions "
                                         rf"\({N_POSITIONS}\), got {N_POSITIONS + 1}"):
        m.generate(ids, mask, max_new_tokens=room + 1)
