"""scaled_masked_softmax microbenchmarks: synthetic [B, H, N, N] scores, forward and backward.

Forward providers, side by side in one group per (shape, dtype, causal):
  eager          x * scale -> masked_fill(mask, -inf) -> softmax: three PyTorch kernels, the bool
                 mask built once outside the timed call, as a user would (two kernels without a mask)
  compiled       torch.compile of the same function, the mask passed in (one compile per case)
  compiled_iota  causal only: torch.compile of the chain with the mask built from torch.arange
                 inside the compiled function (Inductor computes it in the kernel: no mask read)
  fused_v0       our textbook kernel (intermediates in a float32 workspace)
  fused_v1       our fused kernel
Backward providers (dx from dy and the forward's output y), one group per (shape, dtype, causal):
  eager          torch.autograd.grad through the eager chain, the graph built once outside the
                 timed call (retain_graph): softmax backward, masked_fill backward, mul backward
  compiled       torch.compile of dx = scale * y * (dy - sum(dy * y)) on (dy, y): the same inputs
                 and output as ours, and the strongest form for Inductor (one graph, no mask to read,
                 no autograd bookkeeping), so the fair peer of a standalone backward kernel
  fused          fused_attn.softmax.scaled_masked_softmax_backward
Each case's output is checked once against a float64 reference (sampled [seqlen_q, seqlen_k]
slices) before it is timed.

This module owns the softmax providers and their modeled bytes (``modeled_traffic``,
``modeled_backward_traffic``: the fewest bytes each provider's kernels must move), which
``python -m bench.bytes`` measures with ncu and ``python -m bench.report`` tabulates.

extra_info: p5/p50/p95 (us, CUDA events, cold L2), modeled bytes, GB/s, % of the measured
copy bandwidth, speedups vs eager and compiled measured in this run; on a GPU also the time of
a device copy of the same bytes and of an empty kernel, both timed the same way (the floors of
cases too small to reach the copy bandwidth).

Quick default: float16, every shape forward, every shape but batch 16 backward (batch 8 runs the
same kernel classes on half the rows). --full: float32, float16, bfloat16 and every shape both ways.
On a machine without a GPU the cases run on the CPU at a small shape (eager and the
CPU path of fused_v1 / fused), which exercises the harness; GPU numbers need a GPU.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness import bandwidth_info, percentiles, same_run_speedups
from fused_attn import reference
from fused_attn.generate import DTYPES

GPT2_BATCHES = (1, 8, 16)
GPT2_SEQLENS = (128, 512, 1024, 2048)
CPU_SHAPES = [(1, 2, 64, 64)]
QUICK_BACKWARD_SKIPS_BATCH = 16
# Output check before timing: max |out - ref| <= tolerance x max |ref| over the sampled slices (a
# relative bound, so an all-zero or uniform output fails even where every probability is tiny).
CHECK_RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}
CHECK_SLICES = 4  # [seqlen_q, seqlen_k] slices checked per case: first, last and evenly between

PROVIDERS = ("eager", "compiled", "compiled_iota", "fused_v0", "fused_v1")
CAUSAL_ONLY = ("compiled_iota",)  # without a mask it is the same function as `compiled`
BACKWARD_PROVIDERS = ("eager", "compiled", "fused")


def providers(causal: bool, backward: bool = False) -> tuple[str, ...]:
    """The providers measured for a case (forward: compiled_iota only with a causal mask)."""
    if backward:
        return BACKWARD_PROVIDERS
    return tuple(p for p in PROVIDERS if causal or p not in CAUSAL_ONLY)


def visible_elements(shape, causal: bool) -> int:
    *lead, sq, sk = shape
    n_lead = 1
    for d in lead:
        n_lead *= d
    if not causal:
        return n_lead * sq * sk
    return n_lead * int(reference.causal_mask(sq, sk).sum())


def modeled_traffic(provider: str, shape, dtype: torch.dtype, causal: bool) -> tuple[int, int]:
    """Fewest (bytes read, bytes written) each provider's kernels must move through device memory."""
    *lead, sq, sk = shape
    n = visible_elements(shape, False)
    e = torch.empty((), dtype=dtype).element_size()
    mask = sq * sk if causal else 0  # bool causal mask built once, broadcast over the leading dims: read once
    if provider == "eager":  # mul: r+w; masked_fill: r+mask+w; softmax: r+w
        k = 3 if causal else 2
        return k * n * e + mask, k * n * e
    if provider == "compiled":  # the ideal of one fused kernel: read all + the mask, write all
        return n * e + mask, n * e
    if provider == "compiled_iota":  # the mask comes from indices inside the kernel: read all, write all
        return n * e, n * e
    if provider == "fused_v0":
        # Five passes over a float32 workspace row, but a row's passes run back to back in
        # one block and hit L1/L2 (ncu: 0.97 of this): DRAM sees x read, the workspace
        # written once, out written.
        return n * e, n * e + n * 4
    if provider == "fused_v1":  # read the visible elements, write all
        return visible_elements(shape, causal) * e, n * e
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def modeled_backward_traffic(provider: str, shape, dtype: torch.dtype, causal: bool) -> tuple[int, int]:
    """(bytes read, bytes written) of dx from dy and the forward's output y, per backward provider."""
    *lead, sq, sk = shape
    n = visible_elements(shape, False)
    e = torch.empty((), dtype=dtype).element_size()
    if provider == "eager":
        # softmax backward: read y, dy, write g; masked_fill backward (causal): read g + the mask,
        # write g'; mul backward: read g', write dx.
        if causal:
            return 4 * n * e + sq * sk, 3 * n * e
        return 3 * n * e, 2 * n * e
    if provider == "compiled":  # the ideal of one fused kernel on the formula: read y and dy, write dx
        return 2 * n * e, n * e
    if provider == "fused":  # read y and dy over the visible elements, write dx everywhere
        return 2 * visible_elements(shape, causal) * e, n * e
    raise ValueError(f"provider must be one of {BACKWARD_PROVIDERS}, got {provider!r}")


def provider_fn(provider: str, x: torch.Tensor, causal: bool):
    """One call of ``provider`` on scores ``x`` with scale headdim**-0.5 (timed here, profiled by bench.bytes).
    The causal mask of ``eager`` and ``compiled`` is built once, here, as a user would; ``compiled_iota``
    builds it from indices inside the compiled function."""
    from fused_attn.softmax import scaled_masked_softmax

    scale = x.shape[-1] ** -0.5
    masked = ~reference.causal_mask(x.shape[-2], x.shape[-1], x.device) if causal else None
    if provider == "eager":
        return lambda: reference.eager_scaled_masked_softmax(x, scale, masked)
    if provider == "compiled":
        torch._dynamo.reset()  # one compile per case; no recompile limit across shapes
        compiled = torch.compile(reference.eager_scaled_masked_softmax, dynamic=False)
        return lambda: compiled(x, scale, masked)
    if provider == "compiled_iota":
        torch._dynamo.reset()
        compiled = torch.compile(_chain_with_causal_iota, dynamic=False)
        return lambda: compiled(x, scale)
    out = torch.empty_like(x)
    version = 0 if provider == "fused_v0" else 1
    return lambda: scaled_masked_softmax(x, scale, causal=causal, out=out, version=version)


def _chain_with_causal_iota(x: torch.Tensor, scale: float) -> torch.Tensor:
    # torch.arange inside the compiled graph: Inductor computes the mask from indices in the kernel.
    masked = ~reference.causal_mask(x.shape[-2], x.shape[-1], x.device)
    return reference.eager_scaled_masked_softmax(x, scale, masked)


def softmax_backward_formula(grad: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """dx = scale * y * (grad - sum_j grad * y), in float32, cast to y's dtype (the `compiled`
    backward baseline: the same inputs and output as the fused backward)."""
    g, p = grad.float(), y.float()
    return (scale * p * (g - (g * p).sum(-1, keepdim=True))).to(y.dtype)


def backward_provider_fn(provider: str, x: torch.Tensor, dy: torch.Tensor, causal: bool):
    """One backward call of ``provider``: dx for scores ``x`` and output gradient ``dy`` (scale
    headdim**-0.5). ``eager`` runs autograd through the eager chain, its graph built once here
    (retain_graph); ``compiled`` and ``fused`` take the forward's output y, computed once here."""
    from fused_attn import softmax

    scale = x.shape[-1] ** -0.5
    if provider == "eager":
        masked = ~reference.causal_mask(x.shape[-2], x.shape[-1], x.device) if causal else None
        xg = x.detach().requires_grad_()
        y = reference.eager_scaled_masked_softmax(xg, scale, masked)
        return lambda: torch.autograd.grad(y, xg, dy, retain_graph=True)[0]
    y = softmax.scaled_masked_softmax(x, scale, causal=causal)  # masked elements are exact zeros
    if provider == "compiled":
        torch._dynamo.reset()
        compiled = torch.compile(softmax_backward_formula, dynamic=False)
        return lambda: compiled(dy, y, scale)
    if provider == "fused":
        return lambda: softmax.scaled_masked_softmax_backward(dy, y, scale, causal=causal)
    raise ValueError(f"provider must be one of {BACKWARD_PROVIDERS}, got {provider!r}")


# What `python -m bench.bytes --op softmax` measures under ncu: the providers of one shape, causal then full.
BYTES_SHAPE = (8, 12, 1024, 1024)


def bytes_cases(backward: bool) -> list[tuple[bool, str]]:
    """(causal, provider) of every call bench.bytes profiles, in its table's order."""
    return [(causal, p) for causal in (True, False) for p in providers(causal, backward)]


def bytes_model(provider: str, shape, dtype: torch.dtype, causal: bool, backward: bool) -> tuple[int, int]:
    """Modeled (bytes read, bytes written) of one call, forward or backward."""
    return (modeled_backward_traffic if backward else modeled_traffic)(provider, shape, dtype, causal)


def bytes_call(provider: str, shape, dtype: torch.dtype, causal: bool, backward: bool):
    """One call of ``provider`` on random CUDA inputs of ``shape`` (the call bench.bytes profiles)."""
    x = torch.randn(shape, device="cuda").to(dtype)
    if backward:
        return backward_provider_fn(provider, x, torch.randn(shape, device="cuda").to(dtype), causal)
    return provider_fn(provider, x, causal)


# How bench.report names this module's cases (the columns and rows come from the saved extra_info).
REPORT_LABELS = {
    "bench_scaled_masked_softmax": dict(title="scaled_masked_softmax", shape="shape [B,H,N,N]", order=PROVIDERS),
    "bench_scaled_masked_softmax_backward": dict(title="scaled_masked_softmax backward (dx from dy and y)",
                                                 shape="shape [B,H,N,N]", order=BACKWARD_PROVIDERS),
}


def gpu_shapes(config) -> list[tuple[int, int, int, int]]:
    batches = [int(b) for b in config.getoption("--bench-batches").split(",")] if config.getoption(
        "--bench-batches") else GPT2_BATCHES
    seqlens = [int(n) for n in config.getoption("--bench-seqlens").split(",")] if config.getoption(
        "--bench-seqlens") else GPT2_SEQLENS
    shapes = [(b, 12, n, n) for b in batches for n in seqlens]  # GPT-2
    shapes += [(1, 16, n, n) for n in (4096, 8192)]  # long rows
    shapes += [(4, 32, 2048, 2048)]  # Llama-like
    return shapes


def pytest_generate_tests(metafunc):
    for fixture, backward in (("case", False), ("bwd_case", True)):
        if fixture in metafunc.fixturenames:
            cases = make_cases(metafunc.config, backward)
            metafunc.parametrize(fixture, cases, ids=[case_id(c) for c in cases])


def make_cases(config, backward: bool) -> list[dict]:
    if torch.cuda.is_available():
        shapes = gpu_shapes(config)
        if backward and not config.getoption("--full"):
            shapes = [s for s in shapes if s[0] != QUICK_BACKWARD_SKIPS_BATCH]
        names = config.getoption("--bench-dtypes")
        dtypes = names.split(",") if names else (list(DTYPES) if config.getoption("--full") else ["float16"])
    else:
        shapes, dtypes = CPU_SHAPES, ["float32"]
    return [dict(shape=shape, dtype=dtype, causal=causal, provider=provider)
            for shape in shapes for dtype in dtypes for causal in (True, False)
            for provider in providers(causal, backward)]


def case_id(c: dict) -> str:
    return f"{c['provider']}-{'x'.join(map(str, c['shape']))}-{c['dtype']}-{'causal' if c['causal'] else 'full'}"


def check_slices(shape) -> list[int]:
    """Indices into the flattened leading dims of the slices checked against the reference."""
    n = 1
    for d in shape[:-2]:
        n *= d
    return sorted({round(i * (n - 1) / (CHECK_SLICES - 1)) for i in range(CHECK_SLICES)})


def check_output(what: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    """Raise unless max |out - ref| <= CHECK_RTOL[out.dtype] x max |ref| (NaN fails)."""
    err = (out.double() - ref).abs().max().item()
    bound = CHECK_RTOL[out.dtype] * ref.abs().max().item()
    if not err <= bound:
        raise AssertionError(f"{what} must match the float64 reference within {CHECK_RTOL[out.dtype]} x max|ref| "
                             f"= {bound:.3g} before it is timed, got max error {err:.3g}")


def check_forward(what: str, out: torch.Tensor, x: torch.Tensor, scale: float, causal: bool) -> None:
    flat_out, flat_x = out.flatten(0, -3), x.flatten(0, -3)
    for k in check_slices(x.shape):
        ref = reference.scaled_masked_softmax(flat_x[k].double(), scale, causal=causal)
        check_output(f"{what} (slice {k})", flat_out[k], ref)


def check_backward(what: str, dx: torch.Tensor, x: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool) -> None:
    flat_dx, flat_x, flat_dy = dx.flatten(0, -3), x.flatten(0, -3), dy.flatten(0, -3)
    for k in check_slices(x.shape):
        x64 = flat_x[k].double().requires_grad_()
        y64 = reference.scaled_masked_softmax(x64, scale, causal=causal)
        (ref,) = torch.autograd.grad(y64, x64, flat_dy[k].double())
        check_output(f"{what} (slice {k})", flat_dx[k], ref)


def record(benchmark, case: dict, times: list[float], read: int, write: int, device, ceilings_gbps, timer,
           launch_floor_us, medians, direction: str) -> None:
    """extra_info of one case: percentiles, modeled bytes, bandwidth, floors, speedups in this run."""
    shape, provider = case["shape"], case["provider"]
    stats = percentiles(times)
    info = dict(stats, provider=provider, direction=direction, shape=list(shape), dtype=case["dtype"],
                causal=case["causal"], device=str(device))
    info.update(bandwidth_info(read, write, stats["p50_us"], ceilings_gbps, timer, launch_floor_us))
    info.update(same_run_speedups(medians, benchmark.group, provider, stats["p50_us"],
                                  ("eager", "compiled", "compiled_iota")))
    benchmark.extra_info.update(info)


def _inputs(case: dict, device):
    shape, dtype = case["shape"], DTYPES[case["dtype"]]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=device).to(dtype)
    dy = torch.randn(shape, generator=gen, device=device).to(dtype)
    return x, dy, shape[-1] ** -0.5


def _group(case: dict, direction: str) -> str:
    name = "softmax" if direction == "forward" else "softmax_bwd"
    return f"{name} {'x'.join(map(str, case['shape']))} {case['dtype']} {'causal' if case['causal'] else 'full'}"


def bench_scaled_masked_softmax(benchmark, case, device, timer, ceilings_gbps, launch_floor_us, medians):
    provider, causal = case["provider"], case["causal"]
    if device.type == "cpu" and provider in ("compiled", "compiled_iota", "fused_v0"):
        pytest.skip(f"{provider} is measured on a GPU only (no CUDA device here)")
    benchmark.group = _group(case, "forward")
    x, _, scale = _inputs(case, device)
    fn = provider_fn(provider, x, causal)
    check_forward(provider, fn(), x, scale, causal)
    times = timer.run(benchmark, fn)
    read, write = modeled_traffic(provider, case["shape"], x.dtype, causal)
    record(benchmark, case, times, read, write, device, ceilings_gbps, timer, launch_floor_us, medians, "forward")


def bench_scaled_masked_softmax_backward(benchmark, bwd_case, device, timer, ceilings_gbps, launch_floor_us, medians):
    case = bwd_case
    provider, causal = case["provider"], case["causal"]
    if device.type == "cpu" and provider == "compiled":
        pytest.skip("compiled is measured on a GPU only (no CUDA device here)")
    from fused_attn import softmax

    if provider == "fused" and not hasattr(softmax, "scaled_masked_softmax_backward"):
        if device.type == "cuda":
            raise AssertionError("fused_attn.softmax.scaled_masked_softmax_backward must exist to bench the backward")
        pytest.skip("fused_attn.softmax.scaled_masked_softmax_backward is not in this tree")
    benchmark.group = _group(case, "backward")
    x, dy, scale = _inputs(case, device)
    fn = backward_provider_fn(provider, x, dy, causal)
    check_backward(provider, fn(), x, dy, scale, causal)
    times = timer.run(benchmark, fn)
    read, write = modeled_backward_traffic(provider, case["shape"], x.dtype, causal)
    record(benchmark, case, times, read, write, device, ceilings_gbps, timer, launch_floor_us, medians, "backward")
