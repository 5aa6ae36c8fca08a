"""The "fused_attn" attention implementation inside Hugging Face GPT-2: same logits, same tokens."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import fused_attn.hf as fhf  # noqa: E402
from tests.prompts import SMALL, TINY, VARIED, left_padded  # noqa: E402
from tests.rowref import attention_definition, eager_same_dtype  # noqa: E402
from tests.tolerances import assert_close, assert_error_at_most_twice, fp32_tolerance  # noqa: E402



def models(config: dict, device, dtype=torch.float32, impls=("eager", "fused_attn")):
    fhf.register()
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(**config)).eval().to(device, dtype)
    out = {}
    for impl in impls:
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        out[impl] = m
    return out


def test_register_is_idempotent_and_named():
    fhf.register()
    fhf.register()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["fused_attn"] is fhf.fused_attention_forward
    assert "fused_attn" in AttentionMaskInterface._global_mapping


def test_the_fused_op_is_what_runs(monkeypatch):
    calls = []
    real = fhf.scaled_masked_softmax

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fhf, "scaled_masked_softmax", counting)
    m = models(TINY, "cpu", impls=("fused_attn",))["fused_attn"]
    ids, mask = left_padded(TINY["vocab_size"], (24, 17, 9), "cpu")
    m(ids, attention_mask=mask)
    assert len(calls) == TINY["n_layer"]
    assert calls[0]["attn_mask"].dtype == torch.bool and calls[0]["causal"] is True  # padding reached us:
    assert tuple(calls[0]["attn_mask"].shape) == (3, 1, 1, 24)  # causal + key padding, no 4-D mask
    calls.clear()
    m(ids[:1])
    assert calls[0]["attn_mask"] is None and calls[0]["causal"] is True


@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
def test_logits_match_eager_cpu(lengths):
    ms = models(TINY, "cpu")
    ids, mask = left_padded(TINY["vocab_size"], lengths, "cpu")
    want = ms["eager"](ids, attention_mask=mask).logits
    got = ms["fused_attn"](ids, attention_mask=mask).logits
    keep = mask.bool()  # logits of pad positions are not defined the same way
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
def test_greedy_tokens_identical_cpu(lengths, cache):
    ms = models(TINY, "cpu")
    ids, mask = left_padded(TINY["vocab_size"], lengths, "cpu")
    kw = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None)
    if cache == "static":
        kw["cache_implementation"] = "static"
    want = ms["eager"].generate(ids, **kw)
    got = ms["fused_attn"].generate(ids, **kw)
    assert got.shape[1] == ids.shape[1] + 64
    assert torch.equal(got, want)


def generate_logits(model, ids, mask, cache, n=24):
    kw = dict(attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
              output_logits=True, return_dict_in_generate=True)
    if cache == "static":
        kw.update(cache_implementation="static", disable_compile=True)
    out = model.generate(ids, **kw)
    return out.sequences, torch.stack(out.logits, 1).double()  # [batch, n, vocab]


def check_generate_logits(device, lengths, cache):
    """Every step's logits of generate() with fused_attn against eager's, float32."""
    ms = models(VARIED, device)
    ids, mask = left_padded(VARIED["vocab_size"], lengths, device)
    want_seq, want = generate_logits(ms["eager"], ids, mask, cache)
    got_seq, got = generate_logits(ms["fused_attn"], ids, mask, cache)
    assert_close(got, want, fp32_tolerance(want), f"{cache} cache, prompts {lengths}")
    assert torch.equal(got_seq, want_seq)
    assert min(len(set(r.tolist())) for r in want_seq[:, ids.shape[1]:]) >= 6  # the tokens vary


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
def test_generate_logits_match_eager_cpu(lengths, cache):
    check_generate_logits("cpu", lengths, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
def test_generate_logits_match_eager_gpu(lengths, cache):
    check_generate_logits("cuda", lengths, cache)


DECODE_TOKENS = 40  # >= 32 new tokens: 39 decode steps per layer after the prefill's token


def spy_decode(monkeypatch) -> list:
    """Record (q shape, key/value shape, key_mask shape or None) of every decode_attention call that
    fused_attn.hf makes, passing the call on."""
    calls = []
    real = fhf.decode_attention

    def spy(q, k, v, cache_seqlens, **kwargs):
        mask = kwargs.get("key_mask")
        calls.append((tuple(q.shape), tuple(k.shape), None if mask is None else tuple(mask.shape)))
        return real(q, k, v, cache_seqlens, **kwargs)

    monkeypatch.setattr(fhf, "decode_attention", spy)
    return calls


# A tiny Llama with GQA: 4 query heads share 2 key/value heads, headdim 16. initializer_range 0.5 for
# continuations that vary, as VARIED for GPT-2.
LLAMA_GQA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, initializer_range=0.5,
                 bos_token_id=0, eos_token_id=1, pad_token_id=0)


def decode_models(arch: str, device):
    """(eager and fused_attn copies of one seeded model, vocab size, layers, key/value heads) for
    arch "gpt2" (VARIED) or "llama-gqa" (LLAMA_GQA)."""
    if arch == "gpt2":
        return models(VARIED, device), VARIED["vocab_size"], VARIED["n_layer"], VARIED["n_head"]
    from transformers import LlamaConfig, LlamaForCausalLM

    fhf.register()
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**LLAMA_GQA)).eval().to(device)
    ms = {}
    for impl in ("eager", "fused_attn"):
        ms[impl] = copy.deepcopy(base)
        ms[impl].set_attn_implementation(impl)
    return ms, LLAMA_GQA["vocab_size"], LLAMA_GQA["num_hidden_layers"], LLAMA_GQA["num_key_value_heads"]


def check_greedy_decode(monkeypatch, device, arch, lengths, cache):
    """Greedy tokens of fused_attn identical to eager's for DECODE_TOKENS new tokens (logits within
    float32 tolerance), and every decode step of every layer through decode_attention: one query,
    key/value un-repeated (GQA), the whole StaticCache buffer with its unfilled slots masked."""
    ms, vocab, layers, kv_heads = decode_models(arch, device)
    ids, mask = left_padded(vocab, lengths, device)
    want_seq, want = generate_logits(ms["eager"], ids, mask, cache, n=DECODE_TOKENS)
    calls = spy_decode(monkeypatch)
    got_seq, got = generate_logits(ms["fused_attn"], ids, mask, cache, n=DECODE_TOKENS)
    assert torch.equal(got_seq, want_seq)
    assert_close(got, want, fp32_tolerance(want), f"{arch}, {cache} cache, prompts {lengths}")
    assert min(len(set(r.tolist())) for r in want_seq[:, ids.shape[1]:]) >= 6  # the tokens vary
    assert len(calls) == layers * (DECODE_TOKENS - 1), "every decode step must go through decode_attention"
    batch = len(lengths)
    for q, k, key_mask in calls:
        assert q[0] == batch and q[2] == 1 and k[:2] == (batch, kv_heads)
        if cache == "static":  # the whole buffer every step, unfilled slots masked
            assert k[2] == calls[0][1][2] and key_mask == (batch, k[2])
        elif batch > 1:  # padding must reach the op
            assert key_mask == (batch, k[2])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_greedy_decode_through_decode_attention_cpu(monkeypatch, arch, lengths, cache):
    check_greedy_decode(monkeypatch, "cpu", arch, lengths, cache)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [(24,), (24, 17, 9)])
@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_greedy_decode_through_decode_attention_gpu(monkeypatch, arch, lengths, cache):
    check_greedy_decode(monkeypatch, "cuda", arch, lengths, cache)


def check_compiled_static_decode(device, arch):
    """transformers' compiled StaticCache decode (torch.compile of the decode step): greedy tokens as
    eager's, decode_attention in the generated code once per layer, reading the cache buffers in
    place: no clone and no new buffer of the cache's shape (the op's schema marks k_cache/v_cache as
    mutated; inductor must not copy them to honour that)."""
    from torch._inductor.utils import run_and_get_code
    from transformers import CompileConfig

    ms, vocab, layers, _ = decode_models(arch, device)
    ids, mask = left_padded(vocab, (24, 17, 9), device)
    want_seq, want = generate_logits(ms["eager"], ids, mask, "dynamic", n=DECODE_TOKENS)
    kw = dict(attention_mask=mask, max_new_tokens=DECODE_TOKENS, do_sample=False, pad_token_id=0,
              eos_token_id=None, output_logits=True, return_dict_in_generate=True, cache_implementation="static")
    # fullgraph: a graph break in our attention path splits transformers' compiled step at every
    # layer, where dynamo recompiles per layer index and falls back to eager past its recompile limit.
    config = CompileConfig(fullgraph=True, mode="default")
    if device == "cpu":  # transformers compiles on GPUs only unless told otherwise
        config._compile_all_devices = True
    kw["compile_config"] = config
    torch._dynamo.reset()
    out, codes = run_and_get_code(lambda: ms["fused_attn"].generate(ids, **kw))
    got = torch.stack(out.logits, 1).double()
    assert_close(got, want, fp32_tolerance(want), f"{arch}, compiled static cache")
    assert torch.equal(out.sequences, want_seq)
    code = "\n".join(codes)
    launches = [line for line in code.splitlines() if "torch.ops.fused_attn.decode_attention.default(" in line]
    # One graph, a call per layer.
    assert len(launches) >= layers, "the compiled decode step must call decode_attention once per layer"
    cache_shape = str(tuple(out.past_key_values.layers[0].keys.shape))
    copies = [line for line in code.splitlines()
              if ".clone(" in line or ("empty_strided" in line and cache_shape in line)]
    assert not copies, f"the compiled decode copies the cache {cache_shape}: {copies[:3]}"


@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_static_cache_compiled_decode_cpu(arch):
    check_compiled_static_decode("cpu", arch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_static_cache_compiled_decode_gpu(arch):
    check_compiled_static_decode("cuda", arch)


def check_decode_path_choice(monkeypatch, device):
    """A one-query call takes decode_attention only without gradient, dropout or an additive mask;
    every path gives the same attention, and gradients still flow where they are needed."""
    calls = spy_decode(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 8, n, 16, generator=gen).to(device) for n in (1, 12, 12))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()  # GQA 4:1
    keep = (torch.rand(2, 1, 1, 12, generator=gen) > 0.3).to(device)
    keep[..., -1] = True
    attn = _Attn().eval()
    with torch.no_grad():
        fast = fhf.fused_attention_forward(attn, q, k, v, keep, scaling=0.3)[0]
    assert len(calls) == 1 and calls[0][2] == (2, 12)
    want = attention_definition(q, k, v, keep, 0.3, False)
    assert_close(fast, want, fp32_tolerance(want), "decode path")

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    slow = fhf.fused_attention_forward(attn, qg, kg, vg, keep, scaling=0.3)[0]
    slow.sum().backward()
    assert len(calls) == 1, "an input requires grad: the decode path must not be taken"
    assert all(t.grad is not None and t.grad.abs().max() > 0 for t in (qg, kg, vg))
    assert_close(slow.detach(), want, fp32_tolerance(want), "grad path")

    with torch.no_grad():
        fhf.fused_attention_forward(_Attn().train(), q, k, v, keep, dropout=0.1, scaling=0.3)  # dropout
        additive = torch.zeros(keep.shape, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
        fhf.fused_attention_forward(attn, q, k, v, additive, scaling=0.3)
        fhf.fused_attention_forward(_Attn().train(), q, k, v, keep, dropout=0.0, scaling=0.3)  # no dropout: decode
    assert len(calls) == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_path_only_without_grad_dropout_or_additive_mask(monkeypatch, device):
    check_decode_path_choice(monkeypatch, device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_step_ignores_masked_cache_slots_holding_nan(device):
    """Unfilled or padded cache slots may hold anything: masked, they never reach the output."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, n, 16, generator=gen).to(device) for n in (1, 10, 10))
    keep = torch.zeros(2, 1, 1, 10, dtype=torch.bool, device=device)
    keep[0, ..., :6] = True  # a StaticCache filled up to slot 6
    keep[1, ..., 3:8] = True  # left padding, then unfilled slots
    k_bad, v_bad = k.masked_fill(~keep.view(2, 1, 10, 1), float("nan")), v.masked_fill(~keep.view(2, 1, 10, 1),
                                                                                       float("nan"))
    with torch.no_grad():
        got = fhf.fused_attention_forward(_Attn().eval(), q, k_bad, v_bad, keep)[0]
    want = attention_definition(q, k, v, keep, 0.25, False)
    assert_close(got, want, fp32_tolerance(want), "NaN in masked slots")


class _Attn(torch.nn.Module):
    is_causal = True


def attention_case(name, device, gen):
    """q [2, 8, sq, 16], k/v [2, kv_heads, sk, 16], mask, is_causal, and the definition's causal flag."""
    b, h, d = 2, 8, 16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    if name == "gqa-bool-padding":  # 4 query heads per key/value head, mask as sdpa_mask builds it
        sq = sk = 11
        keep = torch.ones(b, 1, sq, sk, dtype=torch.bool).tril()
        keep[1, :, :, :4] = False  # left padding of row 1
        return rnd(b, h, sq, d), rnd(b, 2, sk, d), rnd(b, 2, sk, d), keep.to(device), True, False
    if name == "additive":
        sq, sk = 5, 9
        add = rnd(b, 1, sq, sk)
        add[0, :, :, :3] = -1e4
        return rnd(b, h, sq, d), rnd(b, 4, sk, d), rnd(b, 4, sk, d), add, True, False
    if name == "causal-no-mask":
        sq = sk = 7
        return rnd(b, h, sq, d), rnd(b, h, sk, d), rnd(b, h, sk, d), None, True, True
    if name == "static-cache-prefill":  # 6 prompt tokens in a cache of 10 slots, mask left out
        sq, sk = 6, 10
        k, v = rnd(b, h, sk, d), rnd(b, h, sk, d)
        return rnd(b, h, sq, d), k, v, None, True, ("prefix", sq)
    if name == "decode-padding":
        keep = torch.rand(b, 1, 1, 12, generator=gen) > 0.3
        return rnd(b, h, 1, d), rnd(b, 1, 12, d), rnd(b, 1, 12, d), keep.to(device), True, False
    raise AssertionError(name)


ATTENTION_CASES = ["gqa-bool-padding", "additive", "causal-no-mask", "static-cache-prefill", "decode-padding"]


def check_attention_forward(device, name):
    gen = torch.Generator().manual_seed(len(name))
    q, k, v, mask, is_causal, causal = attention_case(name, device, gen)
    scale = 0.37  # not headdim ** -0.5 = 0.25: the scaling argument must be used
    got, weights = fhf.fused_attention_forward(_Attn().eval(), q, k, v, mask, scaling=scale, is_causal=is_causal)
    assert weights is None
    if causal == ("prefix", q.shape[2]):  # unfilled static-cache slots are not keys
        k, v, causal = k[:, :, :q.shape[2]], v[:, :, :q.shape[2]], True
    want = attention_definition(q, k, v, mask, scale, causal)
    assert_close(got, want, fp32_tolerance(want), name)


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_forward_matches_definition_cpu(name):
    """HF's scaling argument, GQA (key/value heads shared by consecutive query heads), bool and
    additive masks, the causal prefill without a mask, with and without unfilled StaticCache slots."""
    check_attention_forward("cpu", name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_forward_matches_definition_gpu(name):
    check_attention_forward("cuda", name)


# ---------------------------------------------------------------- the mask builder and the 2-D mask


def mask_builders_take_offsets() -> bool:
    """transformers 5.x passes mask builders q_length and q_offset; 4.57 passes cache_position."""
    import inspect

    from transformers.masking_utils import sdpa_mask

    return "q_offset" in inspect.signature(sdpa_mask).parameters


def mask_kwargs(batch, q_len, kv_len, pad=None, *, q_offset=0, kv_offset=0, **extra):
    """The keyword arguments the installed transformers' create_causal_mask passes to a mask builder."""
    kw = dict(batch_size=batch, kv_length=kv_len, kv_offset=kv_offset, attention_mask=pad, allow_is_causal_skip=True,
              dtype=torch.float32, use_vmap=False)
    if mask_builders_take_offsets():
        kw.update(q_length=q_len, q_offset=q_offset, device="cpu")
    else:
        kw.update(cache_position=torch.arange(q_offset, q_offset + q_len))
    kw.update(extra)
    return kw


def padding(batch, width, pads):
    """bool [batch, width], True = a real token; row i starts with pads[i] padding tokens (left padding)."""
    m = torch.ones(batch, width, dtype=torch.bool)
    for i, n in enumerate(pads):
        m[i, :n] = False
    return m


def builder_case(name):
    """(kwargs for the mask builder, the kind it must return: "2d", "none" or "sdpa")."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_causal_mask_function

    if name == "left-padded-prefill":
        return mask_kwargs(3, 9, 9, padding(3, 9, (0, 4, 7))), "2d"
    if name == "padding-mask-wider-than-the-keys":  # sdpa_mask reads the first kv_length columns
        return mask_kwargs(2, 6, 6, padding(2, 9, (0, 2)) & torch.tensor([True] * 6 + [False] * 3)), "2d"
    if name == "one-token-prompt":
        return mask_kwargs(2, 1, 1, padding(2, 1, (0, 1))), "2d"
    if name == "no-padding":
        return mask_kwargs(2, 7, 7, padding(2, 7, (0, 0))), "none"
    if name == "no-padding-mask":
        return mask_kwargs(2, 7, 7), "sdpa"
    if name == "static-cache-prefill":  # 6 prompt tokens, 10 cache slots: the unfilled slots are in the mask
        return mask_kwargs(2, 6, 10, padding(2, 6, (0, 3))), "sdpa"
    if name == "decode-step":
        return mask_kwargs(2, 1, 8, padding(2, 8, (0, 3)), q_offset=7), "sdpa"
    if name == "chunked-prefill":  # 4 more tokens after 5 cached ones
        return mask_kwargs(2, 4, 9, padding(2, 9, (0, 3)), q_offset=5), "sdpa"
    if name == "materialized-mask-asked":
        return mask_kwargs(2, 7, 7, padding(2, 7, (0, 3)), allow_is_causal_skip=False), "sdpa"
    if name == "sliding-window":
        return mask_kwargs(2, 7, 7, padding(2, 7, (0, 3)), mask_function=sliding_window_causal_mask_function(3),
                           local_size=3), "sdpa"
    if name == "causal-and-an-overlay":
        overlay = lambda b, h, q, kv: kv != 2  # noqa: E731
        return mask_kwargs(2, 7, 7, padding(2, 7, (0, 3)),
                           mask_function=and_masks(causal_mask_function, overlay)), "sdpa"
    if name == "kv-offset":
        return mask_kwargs(2, 5, 5, padding(2, 8, (0, 3)), kv_offset=3), "sdpa"
    raise AssertionError(name)


BUILDER_CASES = ["left-padded-prefill", "padding-mask-wider-than-the-keys", "one-token-prompt", "no-padding",
                 "no-padding-mask", "static-cache-prefill", "decode-step", "chunked-prefill", "materialized-mask-asked",
                 "sliding-window", "causal-and-an-overlay", "kv-offset"]


@pytest.mark.parametrize("name", BUILDER_CASES)
def test_mask_builder_is_sdpa_mask_or_its_causal_key_padding(name):
    """fused_attn_mask returns the 2-D padding mask only for a causal prefill from an empty cache with
    padding, where causal AND that padding is sdpa_mask's 4-D mask (the independent definition);
    None where sdpa_mask gives None for it; sdpa_mask's own answer in every other case."""
    from transformers.masking_utils import sdpa_mask

    kw, kind = builder_case(name)
    got = fhf.fused_attn_mask(**kw)
    want = sdpa_mask(**kw)
    if kind == "2d":
        assert got is not None and got.dtype == torch.bool and got.dim() == 2, got
        sq = sk = kw["kv_length"]
        assert tuple(got.shape) == (kw["batch_size"], sk)
        causal = torch.ones(sq, sk, dtype=torch.bool).tril()
        assert want is not None and torch.equal(got[:, None, None, :] & causal, want)
    elif kind == "none":
        assert got is None and want is None
    else:
        assert (got is None and want is None) or torch.equal(got, want), (got, want)
        assert got is None or got.dim() == 4


def test_mask_builder_does_not_read_the_padding_while_tracing():
    """Under tracing the values cannot be read (sdpa_mask then builds the 4-D mask): the 2-D mask is
    returned even when it has no padding, correct whatever its values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        pad = mode.from_tensor(padding(2, 7, (0, 0)))
        got = fhf.fused_attn_mask(**mask_kwargs(2, 7, 7, pad))
    assert got is not None and tuple(got.shape) == (2, 7)


def test_mask_builder_needs_a_prefill_from_an_empty_cache():
    """Queries that do not start at key 0 are not a prefill from an empty cache: sdpa_mask's answer. On
    transformers 5.x an int q_offset other than 0; on 4.57, which passes cache_position (whose values the
    builder does not read: a host read would synchronize), fewer queries than keys (a prompt after a cache)."""
    from transformers.masking_utils import sdpa_mask

    if mask_builders_take_offsets():
        kw = mask_kwargs(2, 5, 5, padding(2, 5, (0, 2)), q_offset=3)
    else:
        kw = mask_kwargs(2, 5, 8, padding(2, 8, (0, 2)), q_offset=3)
    got = fhf.fused_attn_mask(**kw)
    assert got is not None and got.dim() == 4 and torch.equal(got, sdpa_mask(**kw))


def test_register_installs_the_mask_builder():
    from transformers.masking_utils import AttentionMaskInterface

    fhf.register()
    assert AttentionMaskInterface._global_mapping["fused_attn"] is fhf.fused_attn_mask


def key_padding_case(device, dtype, gen, *, batch=3, sq=13, heads=8, kv_heads=2, headdim=16, pads=(0, 5, 13)):
    """q, k, v (GQA: heads query heads on kv_heads key/value heads), the 2-D causal + key padding mask
    of left-padded rows (the last row all padding) and its 4-D equivalent, as sdpa_mask builds it."""
    q = torch.randn(batch, heads, sq, headdim, generator=gen).to(device, dtype)
    k, v = (torch.randn(batch, kv_heads, sq, headdim, generator=gen).to(device, dtype) for _ in range(2))
    key_pad = padding(batch, sq, pads).to(device)
    full = key_pad[:, None, None, :] & torch.ones(sq, sq, dtype=torch.bool, device=device).tril()
    return q, k, v, key_pad, full


def test_key_padding_mask_equals_its_4d_mask_cpu():
    """The forward fed the 2-D mask gives what it gives fed the equivalent 4-D mask (output and, in
    training, gradients), and the definition's attention with that 4-D mask (rows that see no key:
    zeros); left padding, GQA 4:1."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, key_pad, full = key_padding_case("cpu", torch.float32, gen)
    want = attention_definition(q, k, v, full, 0.3, False)
    grads = {}
    for name, mask in (("2-D", key_pad), ("4-D", full)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fhf.fused_attention_forward(_Attn().train(), *leaves, mask, scaling=0.3)[0]
        assert_close(out.detach(), want, fp32_tolerance(want), f"{name} mask")
        assert torch.equal(out[2].detach(), torch.zeros_like(out[2]))  # an all-padding row sees no key
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads[name] = [t.grad for t in leaves]
    for g2, g4, what in zip(grads["2-D"], grads["4-D"], "qkv"):
        assert g2.abs().max() > 0, what
        torch.testing.assert_close(g2, g4, rtol=1e-5, atol=1e-6, msg=f"d{what}")


def test_one_token_prompt_with_a_key_padding_mask_cpu(monkeypatch):
    """q_len == kv_len == 1 with a 2-D mask: the decode path, the padded row all zeros."""
    calls = spy_decode(monkeypatch)
    gen = torch.Generator().manual_seed(12)
    q, k, v, key_pad, _ = key_padding_case("cpu", torch.float32, gen, batch=2, sq=1, pads=(0, 1))
    with torch.no_grad():
        got = fhf.fused_attention_forward(_Attn().eval(), q, k, v, key_pad)[0]
    assert len(calls) == 1 and calls[0][2] == (2, 1)
    torch.testing.assert_close(got[0], v[0].repeat_interleave(4, 0).transpose(0, 1))
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_key_padding_mask_reaches_the_forward_cpu(monkeypatch):
    """A left-padded GPT-2 prefill hands the forward the 2-D mask, a Llama with GQA too (un-repeated
    key/value heads); logits equal eager's at the real tokens."""
    seen = []
    real = fhf.fused_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((tuple(key.shape), None if attention_mask is None else tuple(attention_mask.shape)))
        return real(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    for arch in ("gpt2", "llama-gqa"):
        ms, vocab, layers, kv_heads = decode_models(arch, "cpu")  # registers fused_attention_forward
        monkeypatch.setitem(AttentionInterface._global_mapping, "fused_attn", spy)
        seen.clear()
        ids, mask = left_padded(vocab, (24, 17, 9), "cpu")
        with torch.no_grad():
            want = ms["eager"](ids, attention_mask=mask).logits
            got = ms["fused_attn"](ids, attention_mask=mask).logits
        assert seen == [((3, kv_heads, 24, seen[0][0][3]), (3, 24))] * layers, (arch, seen)
        keep = mask.bool()
        assert_close(got[keep], want[keep], fp32_tolerance(want[keep]), arch)


def test_a_2d_mask_that_is_not_causal_key_padding_raises():
    q = torch.randn(2, 4, 5, 8)
    k = torch.randn(2, 4, 6, 8)
    with pytest.raises(ValueError, match=r"attention_mask must be bool \[batch, seqlen_k\] with seqlen_q == seqlen_k "
                                         r"when it is 2-D \(causal \+ key padding, as fused_attn_mask builds it\), got "
                                         r"torch.bool \(2, 6\) with seqlen_q 5, seqlen_k 6"):
        fhf.fused_attention_forward(_Attn().eval(), q, k, k, torch.ones(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask must be bool .* got torch.float32 \(2, 6\)"):
        fhf.fused_attention_forward(_Attn().eval(), k, k, k, torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"attention_mask must be bool .* got torch.bool \(1, 6\)"):
        fhf.fused_attention_forward(_Attn().eval(), k, k, k, torch.ones(1, 6, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_key_padding_mask_on_flash_matches_sdpa_gpu(monkeypatch, dtype):
    """fp16 / bf16 on CUDA: the 2-D mask runs fused_attn.attention (causal, [B, 1, 1, Sk], un-repeated
    GQA heads), no softmax kernel; against F.scaled_dot_product_attention with the 4-D mask (its rows
    that see no key set to zero: ours are zeros) our error is at most twice SDPA's."""
    gen = torch.Generator().manual_seed(13)
    q, k, v, key_pad, full = key_padding_case("cuda", dtype, gen, sq=77, headdim=64, pads=(0, 5, 77))
    calls = spy_prompt_paths(monkeypatch)
    got = fhf.fused_attention_forward(_Attn().eval(), q, k, v, key_pad, scaling=0.3)[0]
    assert [c[0] for c in calls] == ["attention"], calls
    assert calls[0][1:] == (True, (3, 1, 1, 77), (3, 2, 77, 64))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full, scale=0.3, enable_gqa=True)
    sdpa = sdpa.masked_fill(~full.any(-1, keepdim=True), 0).transpose(1, 2)
    want = attention_definition(q, k, v, full, 0.3, False)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert_error_at_most_twice(got, sdpa, want, 1e-5, "2-D mask on flash")


def spy_prompt_paths(monkeypatch) -> list:
    """Record ("attention", causal, mask shape, key shape) for every fused_attn.attention call fused_attn.hf
    makes and ("softmax",) for every scaled_masked_softmax call, passing them on."""
    calls = []
    real_attention, real_softmax = fhf.attention, fhf.scaled_masked_softmax

    def attention_spy(q, k, v, **kwargs):
        mask = kwargs.get("attn_mask")
        calls.append(("attention", kwargs.get("causal"), None if mask is None else tuple(mask.shape), tuple(k.shape)))
        return real_attention(q, k, v, **kwargs)

    def softmax_spy(*args, **kwargs):
        calls.append(("softmax",))
        return real_softmax(*args, **kwargs)

    monkeypatch.setattr(fhf, "attention", attention_spy)
    monkeypatch.setattr(fhf, "scaled_masked_softmax", softmax_spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt2", "llama-gqa"])
def test_half_precision_prompts_take_the_flash_path_gpu(monkeypatch, arch):
    """fp16 prompts on CUDA: every layer through fused_attn.attention, causal, the padding as [B, 1, 1,
    Sk] (left-padded batch) or no mask (no padding), key/value heads un-repeated, never the softmax
    kernel; float32 keeps Q·Kᵀ -> scaled_masked_softmax -> P·V."""
    ms, vocab, layers, kv_heads = decode_models(arch, "cuda")
    model = ms["fused_attn"]
    calls = spy_prompt_paths(monkeypatch)
    for lengths, mask_shape in (((24, 17, 9), (3, 1, 1, 24)), ((24, 24), None)):
        ids, mask = left_padded(vocab, lengths, "cuda")
        for dtype in (torch.float16, torch.float32):
            calls.clear()
            with torch.no_grad():
                model.to(dtype)(ids, attention_mask=mask)
            if dtype == torch.float16:
                assert len(calls) == layers and all(c[0] == "attention" for c in calls), calls
                for _, causal, got_mask, k_shape in calls:
                    assert causal is True and got_mask == mask_shape and k_shape[:3] == (len(lengths), kv_heads, 24)
            else:
                assert [c[0] for c in calls] == ["softmax"] * layers, calls


def capture_attention_inputs(model, ids, mask):
    """q, k, v, mask and scaling of every layer's fused_attn call in one forward of ``model``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    calls = []

    def capturing(module, query, key, value, attention_mask, **kwargs):
        calls.append((query, key, value, attention_mask, kwargs.get("scaling")))
        return fhf.fused_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fused_attn_capture", capturing)
    AttentionMaskInterface.register("fused_attn_capture", fhf.fused_attn_mask)
    model.set_attn_implementation("fused_attn_capture")
    with torch.no_grad():
        model(ids, attention_mask=mask)
    model.set_attn_implementation("fused_attn")
    return calls


def check_half_precision_attention_per_layer(device, dtype):
    """End to end at float16 / bfloat16: every layer's attention, on the inputs that layer really
    received, against float64; our error at most twice the unfused chain's at the same dtype. The
    half-precision logits carry the rounding of every layer, which hides a 1% error in every
    attention probability (tests/mutations.py: hf-probs-off-by-1pct-half); one layer's output does not.
    The left-padded prompt reaches each layer as the 2-D causal + key padding mask (on CUDA the flash
    path)."""
    config = SMALL if device == "cuda" else dict(SMALL, n_layer=4, vocab_size=1000)  # GPT-2 small's layers
    m = models(config, device, dtype, impls=("fused_attn",))["fused_attn"]
    ids, mask = left_padded(config["vocab_size"], (24, 17, 9), device)
    calls = capture_attention_inputs(m, ids, mask)
    assert len(calls) == config["n_layer"]
    real = mask.bool()  # query rows of padding tokens see no key: zeros here, NaN in the eager chain
    scale = (config["n_embd"] // config["n_head"]) ** -0.5  # GPT-2's (transformers 4.x passes no scaling)
    for layer, (q, k, v, attn_mask, scaling) in enumerate(calls):
        assert scaling in (None, scale)
        assert attn_mask is not None and tuple(attn_mask.shape) == tuple(mask.shape)  # causal + key padding
        full = attn_mask[:, None, None, :]
        want = attention_definition(q, k, v, full, scale, True)[real]
        eager = eager_same_dtype(q, k, v, full, scale, True)[real]
        # Without autograd (the output written in place, in transformers' layout) and with inputs that
        # require grad (the autograd path): both half-precision prompt paths.
        with torch.no_grad():
            ours = fhf.fused_attention_forward(_Attn().eval(), q, k, v, attn_mask, scaling=scaling)[0]
        assert_error_at_most_twice(ours[real].double(), eager, want, 1e-5, f"layer {layer}, no grad")
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        ours = fhf.fused_attention_forward(_Attn().eval(), qg, kg, vg, attn_mask, scaling=scaling)[0]
        assert ours.requires_grad
        assert_error_at_most_twice(ours.detach()[real].double(), eager, want, 1e-5, f"layer {layer}, grad")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_attention_per_layer_cpu(dtype):
    check_half_precision_attention_per_layer("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_attention_per_layer_gpu(dtype):
    check_half_precision_attention_per_layer("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(40,), (40, 29, 13)])
def test_greedy_tokens_identical_gpt2_small_gpu(lengths):
    ms = models(SMALL, "cuda")
    ids, mask = left_padded(SMALL["vocab_size"], lengths, "cuda")
    kw = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = ms["eager"].generate(ids, **kw)
    got = ms["fused_attn"].generate(ids, **kw)
    assert torch.equal(got, want)
    logits_e = ms["eager"](want, attention_mask=torch.ones_like(want)).logits
    logits_f = ms["fused_attn"](want, attention_mask=torch.ones_like(want)).logits
    torch.testing.assert_close(logits_f, logits_e, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_error_at_most_twice_sdpa_gpu(dtype):
    ref = models(SMALL, "cuda", torch.float32, impls=("eager",))["eager"]
    low = models(SMALL, "cuda", dtype, impls=("sdpa", "fused_attn"))
    ids, mask = left_padded(SMALL["vocab_size"], (24, 17, 9), "cuda")
    keep = mask.bool()
    want = ref(ids, attention_mask=mask).logits[keep].double()
    got = {k: m(ids, attention_mask=mask).logits[keep] for k, m in low.items()}
    assert_error_at_most_twice(got["fused_attn"], got["sdpa"], want, 1e-3, "logits vs sdpa", norm="max_abs")


def test_apply_to_gpt2_switches_attention_and_rejects_other_models():
    hf = models(TINY, "cpu", impls=("eager",))["eager"]
    assert fhf.apply_to_gpt2(hf) is hf
    assert hf.config._attn_implementation == "fused_attn"
    ids, mask = left_padded(TINY["vocab_size"], (12, 7))
    eager = models(TINY, "cpu", impls=("eager",))["eager"]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids, attention_mask=mask).logits[mask.bool()],
                                   eager(ids, attention_mask=mask).logits[mask.bool()], rtol=1e-5, atol=1e-5)
    untouched = models(TINY, "cpu", impls=("eager",))["eager"]
    assert fhf.apply_to_gpt2(untouched, attention=False).config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"model must be a transformers GPT-2 model .*got Linear"):
        fhf.apply_to_gpt2(torch.nn.Linear(2, 2))


def check_apply_layer_norm_and_mlp(device):
    """apply_to_gpt2's layer_norm and mlp flags: each LayerNorm and GPT2MLP runs our op (counted), the
    parameters keep their values (the MLP's stored transposed), and greedy tokens equal eager's over
    64 new tokens in float32 (left-padded batch); in training with dropout the MLP runs its own forward."""
    import fused_attn.hf as hf_module

    ms = models(VARIED, device, impls=("eager",))
    eager = ms["eager"]
    ours = copy.deepcopy(eager)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    calls = {"layer_norm": 0, "mlp": 0}
    originals = {name: getattr(hf_module, name) for name in calls}
    for name in calls:
        real = getattr(hf_module, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        setattr(hf_module, name, spy)
    try:
        fhf.apply_to_gpt2(ours, attention=False, layer_norm=True, mlp=True)
        for k, v in ours.state_dict().items():
            assert torch.equal(v, before[k]), k
        ids, mask = left_padded(VARIED["vocab_size"], (24, 17, 9), device)
        kw = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, pad_token_id=0, eos_token_id=None)
        want = eager.generate(ids, **kw)
        got = ours.generate(ids, **kw)
        layers = VARIED["n_layer"]
        assert calls["layer_norm"] >= 64 * (2 * layers + 1) and calls["mlp"] >= 64 * layers, calls
        assert torch.equal(got, want)
        ours.train()
        calls["mlp"] = 0
        ours(ids, attention_mask=mask)
        assert calls["mlp"] == (0 if ours.config.resid_pdrop > 0 else layers)
    finally:
        for name, fn in originals.items():
            setattr(hf_module, name, fn)


def test_apply_to_gpt2_layer_norm_and_mlp_cpu():
    check_apply_layer_norm_and_mlp("cpu")


@pytest.mark.gpu
def test_apply_to_gpt2_layer_norm_and_mlp_gpu():
    check_apply_layer_norm_and_mlp("cuda")


def test_apply_to_gpt2_mlp_needs_tanh_gelu():
    m = models(dict(TINY, activation_function="gelu"), "cpu", impls=("eager",))["eager"]
    with pytest.raises(ValueError, match=r"model.config.activation_function must be gelu_new or gelu_pytorch_tanh "
                                         r"\(GELU's tanh form\) for mlp=True, got 'gelu'"):
        fhf.apply_to_gpt2(m)
    fhf.apply_to_gpt2(m, mlp=False)


@pytest.mark.parametrize("name", ["softcap", "s_aux"])
def test_unsupported_score_transforms_raise(name):
    """Gemma-2's softcap, attention sinks: refused, never silently ignored."""
    from fused_attn.hf import fused_attention_forward

    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=rf"{name} must be None with the fused_attn attention \(not supported\), got"):
        fused_attention_forward(torch.nn.Module(), q, q, q, None, **{name: 30.0 if name == "softcap" else q})
