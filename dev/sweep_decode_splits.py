"""decode_attention's split count, swept: what the heuristic's choice costs against every other.

    python -m dev.sweep_decode_splits [--shapes 1,32,8,128,32768 ...] [--splits 1,8,16,24,33,64] [--rounds 40]
                                      [--layouts contiguous paged:16 paged:16:inorder paged:256]

For each shape [B, Hq, Hkv, D, L] (the cases of bench_decode_attention, same inputs and timing:
cold L2, CUDA events, p50 over ``--rounds``) prints one line per forced ``num_splits`` and one for the
heuristic (``auto``), with % of the measured copy bandwidth on the step's bytes, the same-bytes copy
and the ``sdpa`` provider of the same run, for each cache layout of ``--layouts``: ``contiguous``, or
``paged:SIZE`` (page pools of SIZE slots, pages shuffled as bench_decode_attention's paged provider has them)
and ``paged:SIZE:inorder`` (each sequence's pages in order in the pool: what the shuffle costs). Every output is checked against the float64 reference
once before timing. A tuning tool: it writes nothing, and its lines go to docs/lab-notes/decode-attention.md by hand.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench import bench_decode_attention as bd
from bench.harness import DeviceTimer, measure_ceilings

DEFAULT_SHAPES = ("1,32,8,128,32768", "1,32,8,128,8192", "1,32,32,128,8192", "1,12,12,64,1024")


def _shape(text: str) -> tuple[int, ...]:
    parts = tuple(int(p) for p in text.split(","))
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"shape must be B,Hq,Hkv,D,L, got {text!r}")
    return parts


def _layout(text: str) -> tuple[int | None, bool]:
    """(page size or None for contiguous, shuffled)."""
    parts = text.split(":")
    if parts == ["contiguous"]:
        return None, True
    if parts[0] == "paged" and len(parts) in (2, 3) and parts[1].isdigit() and parts[2:] in ([], ["inorder"]):
        return int(parts[1]), len(parts) == 2
    raise argparse.ArgumentTypeError(f"layout must be contiguous, paged:SIZE or paged:SIZE:inorder, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", type=_shape, default=[_shape(s) for s in DEFAULT_SHAPES])
    ap.add_argument("--splits", default="1,4,8,12,16,24,32,33,48,64")
    ap.add_argument("--dtype", default="float16", choices=sorted(bd.DTYPES))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--layouts", nargs="+", default=["contiguous"])
    args = ap.parse_args(argv)
    try:
        layouts = [(name, _layout(name)) for name in args.layouts]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("dev.sweep_decode_splits needs a CUDA device")
    from fused_attn import decode_attention

    device, dtype = torch.device("cuda"), bd.DTYPES[args.dtype]
    timer = DeviceTimer(device, rounds=args.rounds, warmup=5)
    copy_gbps = measure_ceilings()["copy"]
    print(f"{torch.cuda.get_device_name()} {args.dtype}, copy {copy_gbps:.0f} GB/s, "
          f"empty kernel {timer.launch_floor_us():.2f} us")
    for shape in args.shapes:
        t = bd.make_inputs(shape, dtype, device)
        read, write = bd.modeled_traffic(shape, dtype)
        nbytes = read + write
        floor = nbytes / copy_gbps * 1e-3
        same = timer.same_bytes_copy_us(nbytes)
        sdpa = statistics.median(timer.sample(bd.provider_fn("sdpa", t)))
        print(f"shape {shape}: {nbytes / 1e6:.1f} MB, copy-bandwidth time {floor:.1f} us, same-bytes copy "
              f"{same:.1f} us, sdpa {sdpa:.1f} us")
        for name, (page_size, shuffled) in layouts:
            print(f" layout {name}")
            if page_size is not None:
                bd.page_inputs(t, page_size, shuffled)
            k, v = ("k_cache", "v_cache") if page_size is None else ("k_pool", "v_pool")
            table = None if page_size is None else t["block_table"]
            for splits in [None] + [int(s) for s in args.splits.split(",")]:
                def call(splits=splits):
                    return decode_attention(t["q"], t[k], t[v], t["cache_seqlens"], k_new=t["k_new"],
                                            v_new=t["v_new"], num_splits=splits, block_table=table)
                bd.check_step("fused" if page_size is None else "paged", call(), t)
                p50 = statistics.median(timer.sample(call))
                print(f"  {'auto' if splits is None else splits:>5}: {p50:7.1f} us  {100 * floor / p50:5.1f}% of "
                      f"copy  {sdpa / p50:4.2f}x sdpa")
            for key in ("k_pool", "v_pool", "block_table"):
                t.pop(key, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
