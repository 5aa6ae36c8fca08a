"""Training GPT-2 through the "fused_attn" attention: the same loss and the same gradient for every
parameter as transformers' eager attention, with dropout off and with transformers' default dropout
(same RNG stream, so the same elements are dropped), with and without gradient checkpointing.

Before the op had a backward, dW_q and dW_k came out exactly zero on CUDA (autograd dropped the
gradient through the softmax with only a warning; conftest.py now turns that warning into an error).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import fused_attn.hf as fhf  # noqa: E402
from tests.prompts import SMALL, TINY, left_padded  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# float32 end to end; the two attentions differ in summation order only (softmax and its backward).
GRAD_RTOL, GRAD_ATOL = 2e-4, 2e-6


def training_pair(config: dict, device: str, dropout: float):
    """Eager and fused_attn copies of one seeded GPT-2, in training mode."""
    fhf.register()
    torch.manual_seed(0)
    cfg = GPT2Config(**config, attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
    base = GPT2LMHeadModel(cfg).to(device).train()
    pair = {}
    for impl in ("eager", "fused_attn"):
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        pair[impl] = m
    return pair


def step(model, ids, mask, seed):
    """One forward + backward with labels; returns the loss and every gradient.

    Padding is ignored, and so is each row's first real token: with left padding it is predicted
    from the last padding position, a query with no visible key. There eager attention (additive
    finfo.min mask) averages the values of every key, future ones included, and fused_attn gives
    0 (documented), so that one prediction differs; neither is meaningful."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    labels = ids.masked_fill(mask == 0, -100)
    first_real = mask.argmax(dim=1)
    labels[torch.arange(ids.shape[0], device=ids.device), first_real] = -100
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def assert_same_step(pair, ids, mask, seed=0):
    loss_e, grads_e = step(pair["eager"], ids, mask, seed)
    loss_f, grads_f = step(pair["fused_attn"], ids, mask, seed)
    assert torch.isfinite(loss_f)
    torch.testing.assert_close(loss_f, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_f.keys() == grads_e.keys()
    for name, g_e in grads_e.items():
        g_f = grads_f[name]
        assert g_f is not None, f"{name}: no gradient with fused_attn"
        assert g_e.abs().max() > 0, f"{name}: eager gradient is zero, the comparison would prove nothing"
        torch.testing.assert_close(g_f, g_e, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_step_matches_eager_tiny(device, dropout, checkpointing):
    pair = training_pair(TINY, device, dropout)
    if checkpointing:
        for m in pair.values():  # transformers 5 renamed it; 4.x has only the old name
            (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
    ids, mask = left_padded(TINY["vocab_size"], (24, 17, 9), device)
    assert_same_step(pair, ids, mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_training_step_matches_eager_gpt2_small(device, dropout):
    pair = training_pair(SMALL, device, dropout)
    ids, mask = left_padded(SMALL["vocab_size"], (32, 20), device)
    assert_same_step(pair, ids, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_query_and_key_projections_get_gradient(device):
    """The regression itself: c_attn's query and key columns had exactly zero gradient on CUDA."""
    pair = training_pair(TINY, device, 0.0)
    ids, mask = left_padded(TINY["vocab_size"], (16, 16), device)
    _, grads = step(pair["fused_attn"], ids, mask, 0)
    e = TINY["n_embd"]
    for layer in range(TINY["n_layer"]):
        g = grads[f"transformer.h.{layer}.attn.c_attn.weight"]  # Conv1D: [n_embd, 3 * n_embd] = q | k | v
        for part, cols in (("q", slice(0, e)), ("k", slice(e, 2 * e)), ("v", slice(2 * e, 3 * e))):
            assert g[:, cols].abs().max() > 0, f"layer {layer}: d{part} is all zero"


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_is_applied_in_training_only(device):
    """With dropout 0.5 the training-mode attention output changes with the seed; in eval mode it does not."""
    fhf.register()
    pair = training_pair(TINY, device, 0.0)
    m = pair["fused_attn"]
    attn = m.transformer.h[0].attn
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(2, 4, 7, 16, generator=gen, device=device) for _ in range(3))
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        outs.append(fhf.fused_attention_forward(attn, q, k, v, None, dropout=0.5)[0])
    assert not torch.equal(outs[0], outs[1])
    m.eval()
    evals = [fhf.fused_attention_forward(attn, q, k, v, None, dropout=0.5)[0] for _ in range(2)]
    assert torch.equal(evals[0], evals[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("problem_type", ["regression", "single_label_classification", "multi_label_classification"])
def test_sequence_classification_training_matches_eager(device, problem_type):
    """GPT2ForSequenceClassification's three problem types (transformers' test_problem_types): loss and
    every gradient as with eager attention, transformers' default dropout 0.1 on the same RNG stream."""
    from transformers import GPT2ForSequenceClassification

    fhf.register()
    torch.manual_seed(0)
    cfg = GPT2Config(**TINY, num_labels=3, pad_token_id=0, problem_type=problem_type)
    base = GPT2ForSequenceClassification(cfg).to(device).train()
    ids, mask = left_padded(TINY["vocab_size"], (12, 7, 10), device)
    gen = torch.Generator().manual_seed(2)
    if problem_type == "regression":
        labels = torch.randn(3, 3, generator=gen)
    elif problem_type == "single_label_classification":
        labels = torch.randint(0, 3, (3,), generator=gen)
    else:
        labels = (torch.rand(3, 3, generator=gen) > 0.5).float()
    labels = labels.to(device)
    results = {}
    for impl in ("eager", "fused_attn"):
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        torch.manual_seed(3)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results[impl] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()})
    (loss_e, grads_e), (loss_f, grads_f) = results["eager"], results["fused_attn"]
    torch.testing.assert_close(loss_f, loss_e, rtol=1e-5, atol=1e-6)
    for name, g_e in grads_e.items():
        assert grads_f[name] is not None, f"{name}: no gradient with fused_attn"
        torch.testing.assert_close(grads_f[name], g_e, rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")
