"""What a paged KV cache costs the memory system, apart from any attention kernel (GPU, ~1 min):

    python -m dev.probe_paged_floor [--shapes 4,32,8,64,131072 ...] [--blocks-per-sm 3]
                                    [--layouts contiguous paged:16 paged:16:inorder paged:64]

For each shape [B, Hq, Hkv, D, L] (bench_decode_attention's inputs, fp16) and cache layout, times
`decode_attention` (the heuristic's splits) and a gather floor: a Triton kernel that reads the same K and V rows
in the same order and does nothing with them but sum them. Its grid is one program a (sequence, kv head, split),
with the splits for --blocks-per-sm programs an SM. Each program steps through its split 64 slots at a time
(the tensor-core kernel's tile), as pages of the layout's size (contiguous: the cache cut into 16-slot runs).
Layouts: `contiguous`; `paged:SIZE`, the pools and the shuffled pages of bench_decode_attention's paged provider;
`paged:SIZE:inorder`, each sequence's pages in order in the pool.

The floor's paged / contiguous ratio is what the layout costs DRAM and the TLB. The op's ratio beyond it is
the kernel's own. Cold L2, CUDA events, p50 (bench.harness.DeviceTimer). Triton ships with PyTorch's CUDA
wheels; nothing is written into the checkout.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import bench_decode_attention as bd
from bench.harness import DeviceTimer

DEFAULT_SHAPES = ("4,32,8,64,131072", "16,32,8,64,32768", "1,32,8,64,131072", "4,32,32,64,131072")
TILE = 64  # slots a program reads a step


def _gather_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum(kp, vp, table, out, n_blocks, per_split, PAGE: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
        # table[bh, i]: the i-th PAGE x D block of (sequence, kv head) bh in kp / vp viewed as [blocks, PAGE, D].
        bh = tl.program_id(0)
        s = tl.program_id(1)
        offs = tl.arange(0, PAGE)[None, :, None] * D + tl.arange(0, D)[None, None, :]
        acc = tl.zeros([P, PAGE, D], tl.float32)
        lo = s * per_split
        hi = tl.minimum(lo + per_split, n_blocks)
        for i in tl.range(lo, hi, P, num_stages=4):
            idx = i + tl.arange(0, P)
            live = idx < hi
            pages = tl.load(table + bh.to(tl.int64) * n_blocks + idx, mask=live, other=0).to(tl.int64)
            ptr = pages[:, None, None] * (PAGE * D) + offs
            m = live[:, None, None]
            acc += tl.load(kp + ptr, mask=m, other=0.).to(tl.float32) + tl.load(vp + ptr, mask=m, other=0.).to(tl.float32)
        rows = tl.arange(0, PAGE)[:, None] * D + tl.arange(0, D)[None, :]
        tl.store(out + (bh * tl.num_programs(1) + s) * PAGE * D + rows, tl.sum(acc, 0))

    return gather_sum


def floor_call(kernel, t: dict, page: int | None, splits: int):
    """The gather floor over t's contiguous caches (page None) or its pools (bd.page_inputs)."""
    b, hkv, n, d = t["k_cache"].shape
    size = page or 16
    nb = n // size
    if page is None:
        kp, vp = t["k_cache"].reshape(-1, size, d), t["v_cache"].reshape(-1, size, d)
        table = torch.arange(b * hkv * nb, device=kp.device, dtype=torch.int32).view(b * hkv, nb)
    else:
        kp, vp = t["k_pool"].reshape(-1, size, d), t["v_pool"].reshape(-1, size, d)
        pages = t["block_table"].to(torch.int64)
        heads = torch.arange(hkv, device=kp.device)
        table = (pages[:, None, :] * hkv + heads[None, :, None]).reshape(b * hkv, nb).to(torch.int32).contiguous()
    out = torch.empty(b * hkv * splits, size, d, device=kp.device, dtype=torch.float32)
    p = max(1, TILE // size)
    per = -(-nb // splits)
    per = -(-per // p) * p
    grid = (b * hkv, splits)
    return lambda: kernel[grid](kp, vp, table, out, nb, per, PAGE=size, D=d, P=p, num_warps=4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "paged:16", "paged:16:inorder", "paged:64"])
    ap.add_argument("--blocks-per-sm", type=int, default=3, help="the floor's programs an SM (its splits)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("dev.probe_paged_floor needs a CUDA device")
    from fused_attn import decode_attention

    device = torch.device("cuda")
    kernel = _gather_kernel()
    timer = DeviceTimer(device, rounds=args.rounds, warmup=3)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, float16, floor at {args.blocks_per_sm} programs an SM")
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        t = bd.make_inputs(shape, torch.float16, device)
        b, _, hkv, _, _ = shape
        splits = max(1, min(args.blocks_per_sm * sms // (b * hkv), 64))
        base: dict[str, float] = {}
        for layout in args.layouts:
            page = None
            if layout != "contiguous":
                _, size, *order = layout.split(":")
                page = int(size)
                bd.page_inputs(t, page, shuffled=not order)
            k, v = ("k_cache", "v_cache") if page is None else ("k_pool", "v_pool")
            table = None if page is None else t["block_table"]
            ours = statistics.median(timer.sample(
                lambda: decode_attention(t["q"], t[k], t[v], t["cache_seqlens"], block_table=table)))
            floor = statistics.median(timer.sample(floor_call(kernel, t, page, splits)))
            base = base or dict(ours=ours, floor=floor)
            print(f"{text:20s} {layout:18s} op {ours:8.1f} us ({ours / base['ours']:.3f}x)  floor {floor:8.1f} us "
                  f"({floor / base['floor']:.3f}x)  op / floor {ours / floor:.2f}", flush=True)
            for key in ("k_pool", "v_pool", "block_table"):
                t.pop(key, None)
        del t
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
