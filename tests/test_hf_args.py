"""fused_attn.hf at non-default values: the attention called with ``is_causal=False`` and no mask (an
encoder, cross-attention), a module whose ``is_causal`` is False, a custom scaling with grouped heads,
checked against ``F.scaled_dot_product_attention`` and a BERT encoder's eager attention; and
``apply_to_gpt2`` on a checkpoint whose norms, biases and ``layer_norm_epsilon`` are not the defaults,
against the unpatched model's logits."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
import fused_attn.hf as fhf  # noqa: E402
from tests.prompts import VARIED, left_padded  # noqa: E402
from tests.test_gpt2_args import varied_model  # noqa: E402

B, HQ, HKV, D = 2, 4, 2, 8
SCALE = 0.3


def _qkv(q_len, kv_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, q_len, D, generator=gen, dtype=torch.float64),
            torch.randn(B, HKV, kv_len, D, generator=gen, dtype=torch.float64),
            torch.randn(B, HKV, kv_len, D, generator=gen, dtype=torch.float64))


def _want(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=SCALE,
                                          enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("q_len, kv_len", [(4, 6), (5, 5), (1, 6)])
def test_is_causal_false_without_a_mask_attends_everywhere(q_len, kv_len):
    q, k, v = _qkv(q_len, kv_len)
    module = SimpleNamespace(is_causal=True, training=False)
    with torch.no_grad():
        got, _ = fhf.fused_attention_forward(module, q, k, v, None, scaling=SCALE, is_causal=False)
    torch.testing.assert_close(got, _want(q, k, v))


def test_a_module_that_is_not_causal_attends_everywhere():
    q, k, v = _qkv(5, 5)
    module = SimpleNamespace(is_causal=False, training=False)
    got, _ = fhf.fused_attention_forward(module, q, k, v, None, scaling=SCALE)
    torch.testing.assert_close(got, _want(q, k, v))
    got, _ = fhf.fused_attention_forward(module, q, k, v, None, scaling=SCALE, is_causal=True)
    torch.testing.assert_close(got, _want(q, k, v, causal=True))


def test_bool_mask_with_is_causal_false_and_one_query():
    q, k, v = _qkv(1, 6)
    mask = torch.ones(B, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., :2] = False
    with torch.no_grad():  # the decode_attention path
        got, _ = fhf.fused_attention_forward(SimpleNamespace(is_causal=True, training=False), q, k, v, mask,
                                             scaling=SCALE, is_causal=False)
    torch.testing.assert_close(got, _want(q, k, v, mask))


def test_bert_encoder_matches_its_eager_attention():
    """A bidirectional encoder (transformers calls the attention with is_causal False) with padding."""
    from transformers import BertConfig, BertModel

    fhf.register()
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    eager = BertModel(cfg, add_pooling_layer=False).eval()
    fused = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    fused.set_attn_implementation(fhf.NAME)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding, as BERT's tokenizers pad
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).last_hidden_state
        got = fused(ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags", [dict(attention=False, mlp=False), dict(attention=False, layer_norm=False), {}])
def test_apply_to_gpt2_on_a_varied_checkpoint_matches_the_unpatched_model(flags):
    hf = varied_model()
    patched = fhf.apply_to_gpt2(copy.deepcopy(hf), **flags)
    ids, mask = left_padded(VARIED["vocab_size"], (12, 7, 3))
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        got = patched(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
