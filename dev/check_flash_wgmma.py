"""Quick check of the flash kernel's versions on one GPU (~30 s): the error of mode='flash_mma'
(mma.sync) and mode='flash_wgmma' (Hopper wgmma, with the loader csrc/attention/attention_heuristics.h
picks: TMA for these tensors) against PyTorch's SDPA and against the float64 reference on the first
(batch, head), and the TFLOP/s of each beside SDPA's flash and cuDNN backends. The cp.async loader's
times: `python -m bench.ab flash-tma-off` (bench/bench_attention.py on a copy of the tree built without TMA).

    python -m dev.check_flash_wgmma            # float16
    python -m dev.check_flash_wgmma --bf16     # bfloat16 too

Shapes: Llama-like B1 H32 S4096 D128 causal and not, GPT-2 B1 H12 S1024 D64 causal. FLOPs are
4 B H S² D, half under causal. Timing: median of CUDA-event times over 20 calls after 5 warm-up
calls (warm L2: a quick look; bench/bench_attention.py is the measurement). Prints one line per
(shape, provider); exits 1 if an error is over its bound (2x SDPA-flash's own error vs float64 +
1e-3) or mode='flash_wgmma' cannot run here.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fused_attn import attention, reference

SHAPES = [(1, 32, 4096, 128, False), (1, 32, 4096, 128, True), (1, 12, 1024, 64, True)]  # B, H, S, D, causal


def sdpa(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


PROVIDERS = {
    "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    "flash_mma": lambda q, k, v, causal: attention(q, k, v, causal=causal, mode="flash_mma"),
    "flash_wgmma": lambda q, k, v, causal: attention(q, k, v, causal=causal, mode="flash_wgmma"),
}


def median_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bf16", action="store_true", help="bfloat16 as well as float16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_flash_wgmma: needs a CUDA device")
        return 1
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  CUDA {torch.version.cuda}")
    ok = True
    for dtype in [torch.float16] + ([torch.bfloat16] if args.bf16 else []):
        for b, h, s, d, causal in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
            ref, _ = reference.attention(q[:1, :1].double(), k[:1, :1].double(), v[:1, :1].double(), causal=causal)
            flops = 4 * b * h * s * s * d // (2 if causal else 1)
            outs, err_ref = {}, {}
            for name, fn in PROVIDERS.items():
                try:
                    outs[name] = fn(q, k, v, causal)
                except (RuntimeError, ValueError) as e:
                    print(f"  {name}: cannot run here ({str(e).splitlines()[0][:160]})")
                    ok = ok and not name.startswith("flash_wgmma")
                    continue
                err_ref[name] = (outs[name][:1, :1].double() - ref).abs().max().item()
            bound = 2 * err_ref.get("sdpa_flash", 0.0) + 1e-3
            tag = f"{str(dtype).removeprefix('torch.')} B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}"
            for name, out in outs.items():
                ms = median_ms(lambda: PROVIDERS[name](q, k, v, causal))
                peer = outs.get("sdpa_flash")
                vs_sdpa = (out.float() - peer.float()).abs().max().item() if peer is not None else float("nan")
                bad = name.startswith("flash") and (err_ref[name] > bound or not torch.isfinite(out).all())
                ok = ok and not bad
                print(f"{tag:34s} {name:12s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  "
                      f"max|err| vs float64 {err_ref[name]:.2e} (bound {bound:.2e})  vs sdpa_flash {vs_sdpa:.2e}"
                      f"{'  <-- FAIL' if bad else ''}")
            del q, k, v, outs
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
