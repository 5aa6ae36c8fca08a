"""The direct path (csrc/direct/direct.cpp, fused_attn._ops.direct): an eager CUDA call that needs nothing
of the dispatcher runs the op's CUDA implementation without it; every other call goes through torch.ops.

Checked against the dispatcher path itself (torch.ops.fused_attn.*, the same CUDA implementation): the
direct path gives the same bits, is the one taken for plain CUDA tensors (a spy on the module), and
declines (returns None, so the wrapper takes the dispatcher) for what the dispatcher must see: an input
that requires grad, a dispatch mode, a tensor subclass, a CPU tensor. Bad inputs raise the wrappers'
messages (the dispatcher path's checks), not the launcher's: tests/test_bad_inputs.py runs every row
on CUDA too. GPU only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fused_attn
from fused_attn import _ops

pytestmark = pytest.mark.gpu


def _r(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


def _cases():
    """(name, public call, the same op through torch.ops) at small GPT-2 shapes."""
    ops = torch.ops.fused_attn
    x, w, b = _r(4, 768), _r(768, seed=1), _r(768, seed=2)
    res = _r(4, 768, seed=3)
    W, bb = _r(2304, 768, seed=4), _r(2304, seed=5)
    wfc, bfc, wpr, bpr = _r(3072, 768, seed=6), _r(3072, seed=7), _r(768, 3072, seed=8), _r(768, seed=9)
    s = _r(2, 12, 16, 16, seed=10)
    q, k, v = _r(1, 12, 64, 64, seed=11), _r(1, 4, 64, 64, seed=12), _r(1, 4, 64, 64, seed=13)
    logits = _r(3, 50257, seed=14)
    return [
        ("layer_norm", lambda: fused_attn.layer_norm(x, w, b, 1e-5), lambda: ops.layer_norm(x, w, b, 1e-5)),
        ("rms_norm", lambda: fused_attn.rms_norm(x, w, 1e-6), lambda: ops.layer_norm(x, w, None, 1e-6, rms=True)),
        ("add_layer_norm", lambda: fused_attn.layer_norm(x, w, b, 1e-5, residual=res),
         lambda: ops.add_layer_norm(x, res, w, b, 1e-5)),
        ("linear", lambda: fused_attn.linear(x, W, bb, activation="gelu_tanh"),
         lambda: ops.linear(x, W, bb, None, activation=1)),
        ("mlp", lambda: fused_attn.mlp(x, wfc, bfc, wpr, bpr, residual=res),
         lambda: ops.mlp(x, wfc, bfc, wpr, bpr, res, activation=1)),
        ("softmax", lambda: fused_attn.scaled_masked_softmax(s, 0.5, causal=True),
         lambda: ops.scaled_masked_softmax(s, 0.5, None, causal=True)),
        ("attention", lambda: fused_attn.attention(q, k, v, causal=True, return_lse=True),
         lambda: ops.attention(q, k, v, None, None, causal=True, return_lse=True)),
        ("sample", lambda: fused_attn.sample(logits, 0.8, top_k=40, seed=3, offset=5),
         lambda: ops.sample(logits, 0.8, 3, 5, None, top_k=40)),
    ]


class _Spy:
    """Stands in for fused_attn._ops.direct: records each function called and what it returned."""

    def __init__(self, module):
        self.module, self.calls = module, []

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def call(*args):
            result = fn(*args)
            self.calls.append((name, result is not None))
            return result

        return call


@pytest.fixture
def spy(cuda, monkeypatch):
    fused_attn.load()
    s = _Spy(_ops.direct)
    monkeypatch.setattr(_ops, "direct", s)
    return s


def _same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item()}"


NAMES = ("layer_norm", "rms_norm", "add_layer_norm", "linear", "mlp", "softmax", "attention", "sample")


@pytest.mark.parametrize("name", NAMES)
def test_direct_path_is_taken_and_equals_the_dispatcher_path(spy, name):
    cases = {c[0]: c[1:] for c in _cases()}
    assert tuple(cases) == NAMES
    public, dispatched = cases[name]
    got = public()
    assert spy.calls and spy.calls[-1][1], f"{name}: the direct path was not taken ({spy.calls})"
    want = dispatched()
    _same(got, want)


def test_decode_attention_direct_path_appends_and_bumps_the_caches_version(spy):
    q, kc, vc = _r(2, 12, 1, 64), _r(2, 4, 40, 64, seed=1), _r(2, 4, 40, 64, seed=2)
    kn, vn = _r(2, 4, 1, 64, seed=3), _r(2, 4, 1, 64, seed=4)
    lens = torch.tensor([7, 30], dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    versions = kc._version, vc._version
    got = fused_attn.decode_attention(q, kc, vc, lens, k_new=kn, v_new=vn)
    assert spy.calls == [("decode_attention", True)]
    assert kc._version > versions[0] and vc._version > versions[1]
    want = torch.ops.fused_attn.decode_attention(q, kc2, vc2, lens, kn, vn)
    _same(got, want)
    _same((kc, vc), (kc2, vc2))


def test_qkv_decode_attention_direct_path_bumps_the_caches_version(spy):
    x, w, b = _r(2, 1, 768), _r(2304, 768, seed=1) * 0.05, _r(2304, seed=2)
    kc, vc = _r(2, 12, 32, 64, seed=3), _r(2, 12, 32, 64, seed=4)
    lens = torch.tensor([3, 17], dtype=torch.int32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    version = kc._version
    got = fused_attn.qkv_decode_attention(x, w, b, kc, vc, lens)
    assert spy.calls == [("qkv_decode_attention", True)]
    assert kc._version > version
    want = torch.ops.fused_attn.qkv_decode_attention(x, w, b, kc2, vc2, lens, None, 1e-5, 0.125)
    _same(got, want)
    _same((kc, vc), (kc2, vc2))


@pytest.mark.parametrize("return_lse", [False, True])
def test_attention_out_direct_path_writes_a_transposed_out_and_bumps_its_version(spy, return_lse):
    """out= a [batch, seqlen, heads, headdim] buffer seen as [batch, heads, seqlen, headdim] (the layout the
    Hugging Face forward hands back): the direct path is taken, writes every element of it, returns it and
    bumps its version; the values are the dispatcher's, from a contiguous out."""
    q, k, v = _r(2, 8, 48, 64, seed=1), _r(2, 4, 48, 64, seed=2), _r(2, 4, 48, 64, seed=3)
    buf = torch.full((2, 48, 8, 64), float("nan"), device="cuda", dtype=torch.float16)
    out = buf.transpose(1, 2)
    version = buf._version
    got = fused_attn.attention(q, k, v, causal=True, out=out, return_lse=return_lse)
    assert spy.calls == [("attention_out", True)]
    o = got[0] if return_lse else got
    assert o is out and buf._version > version
    want = torch.ops.fused_attn.attention(q, k, v, None, None, causal=True, return_lse=return_lse)
    _same(buf, want[0].transpose(1, 2).contiguous())
    if return_lse:
        _same(got[1], want[1])


def test_an_input_that_requires_grad_goes_through_autograd(spy):
    x = _r(4, 768).requires_grad_()
    w, b = _r(768, seed=1), _r(768, seed=2)
    y = fused_attn.layer_norm(x, w, b)
    assert spy.calls == [("layer_norm", False)]  # declined: the dispatcher records the backward
    assert y.grad_fn is not None
    y.float().square().sum().backward()
    xf = x.detach().float().requires_grad_()
    F.layer_norm(xf, (768,), w.float(), b.float()).square().sum().backward()
    torch.testing.assert_close(x.grad.float(), xf.grad, atol=2e-2, rtol=2e-2)


def test_no_grad_and_inference_mode_take_the_direct_path(spy):
    x = _r(4, 768).requires_grad_()
    w = _r(768, seed=1)
    with torch.no_grad():
        y = fused_attn.layer_norm(x, w)
    with torch.inference_mode():
        z = fused_attn.layer_norm(x.detach(), w)
    assert spy.calls == [("layer_norm", True), ("layer_norm", True)]
    assert y.grad_fn is None and z.is_inference()
    _same(y, z.clone())


def test_a_dispatch_mode_sees_the_op(spy):
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = _r(4, 768), _r(768, seed=1)
    with Record():
        fused_attn.layer_norm(x, w)
    assert spy.calls == [("layer_norm", False)]
    assert any("fused_attn.layer_norm" in s for s in seen), seen


def test_a_tensor_subclass_goes_through_the_dispatcher(spy):
    class Tagged(torch.Tensor):
        pass

    x, w = _r(4, 768), _r(768, seed=1)
    y = fused_attn.layer_norm(x.as_subclass(Tagged), w)
    assert spy.calls == [("layer_norm", False)]
    _same(y.as_subclass(torch.Tensor), torch.ops.fused_attn.layer_norm(x, w, None, 1e-5))


def test_a_cpu_tensor_among_cuda_ones_gets_the_wrappers_message(spy):
    x = _r(4, 768)
    with pytest.raises(ValueError, match=r"^weight must be on the same device as x \(cuda:0\), got cpu"):
        fused_attn.layer_norm(x, torch.ones(768, dtype=torch.float16))
    assert spy.calls == [("layer_norm", False)]


def test_a_bad_value_raises_the_wrappers_message(spy):
    # The launcher says "got -1"; the wrapper, whose message the tests pin, "got -1.0".
    with pytest.raises(ValueError, match=r"^eps must be a finite number >= 0, got -1\.0$"):
        fused_attn.layer_norm(_r(4, 768), eps=-1.0)


def test_captured_in_a_cuda_graph(spy):
    x, w, b = _r(4, 768), _r(768, seed=1), _r(768, seed=2)
    fused_attn.layer_norm(x, w, b)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fused_attn.layer_norm(x, w, b)
    x.copy_(_r(4, 768, seed=9))
    g.replay()
    assert all(taken for _, taken in spy.calls)
    _same(y, torch.ops.fused_attn.layer_norm(x, w, b, 1e-5))
