"""A small GPU subset for compute-sanitizer (memcheck, racecheck): odd sizes, every
launch-shape class, long rows, fully masked rows, masks, both versions, and the backward; and
decode_attention: appends, GQA / MQA, forced splits (more than keys too), left padding, head dims
32 to 256, float32, ragged batches (cu_seqlens_q: zero-length sequences, idle rows, a paged cache, the combine
kernel), out-of-bounds device lengths and offsets (which must read and write nothing), and over a
paged cache (pages in random order, 16 and 256 slots, appends across a page boundary, split boundaries
inside a page, block_table entries out of the pool, which must read and write nothing); layer_norm /
rms_norm: every row class, odd widths, misaligned and strided rows, with and without the residual, and
gathered rows with indices out of range;
attention: the flash kernel at every padded head dim (both versions at 128 on Hopper, and head dim
64's three wgmma tiles), odd lengths, Sq != Sk under causal, each mask form, strided q/k/v, and the
naive and tiled modes; and linear: every rows-of-x class, weight rows per block and epilogue, the
element-wise path (odd K, misaligned rows) and the tensor-core kernels (one block per 16 weight rows,
and split-K in clusters), the first two also with the LayerNorm / RMSNorm prologue (norm=: the
normalized rows in shared memory), the one-row fold of a weightless norm into the dot products and the
self-normalizing tensor-core kernel; sample: greedy and sampled, one block and a cluster per row,
misaligned and strided rows, the token history; qkv_decode_attention: the cluster's exchange and merge
(batch 1-3, d 256 / 768, leftpad, the new key only, the last slot) and out-of-bounds lengths.

    compute-sanitizer --tool memcheck  python tests/sanitizer_cases.py
    compute-sanitizer --tool racecheck python tests/sanitizer_cases.py --quick
    compute-sanitizer --tool memcheck  python tests/sanitizer_cases.py --only linear,attention

(--only: a comma-separated subset of softmax, decode, norm, attention, linear, sample, qkv.)

Exits non-zero if any result differs from the float64 reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fused_attn import reference  # noqa: E402
from fused_attn.softmax import scaled_masked_softmax, scaled_masked_softmax_backward  # noqa: E402
from tests import test_decode_attention_ragged as ragged  # noqa: E402
from tests.test_decode_attention import case_of, run_and_check  # noqa: E402
from tests.test_softmax import scores_of  # noqa: E402
from tests.tolerances import assert_close, softmax_tolerance  # noqa: E402


GROUPS = ("softmax", "decode", "norm", "attention", "linear", "sample", "qkv")


def main(argv: list[str]) -> int:
    quick = "--quick" in argv  # racecheck is slow: one dtype, one length per launch class
    only = set(GROUPS)
    if "--only" in argv:
        at = argv.index("--only")
        only = set(argv[at + 1].split(",")) if at + 1 < len(argv) else set()
        if not only or not only <= set(GROUPS):
            raise SystemExit(f"--only must name groups among {', '.join(GROUPS)}, got {argv[at + 1:at + 2]}")
    cases = softmax_cases(quick) if "softmax" in only else 0
    for name, run in (("decode", decode_cases), ("norm", norm_cases), ("attention", attention_cases),
                      ("linear", linear_cases), ("sample", sample_cases), ("qkv", qkv_cases)):
        if name in only:
            cases += run(quick)
    torch.cuda.synchronize()
    print(f"sanitizer cases: {cases} passed ({', '.join(g for g in GROUPS if g in only)})")
    return 0


def softmax_cases(quick: bool) -> int:
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = 0
    lengths = (3, 65, 1023, 1025, 2049, 5001, 8193, 32769) if quick else (
        1, 3, 33, 65, 129, 257, 513, 1023, 1025, 2049, 4097, 5001, 8192, 8193, 16385, 32769)
    dtypes = (torch.float16,) if quick else (torch.float32, torch.float16, torch.bfloat16)
    for sk in lengths:
        for dtype in dtypes:
            for version in (0, 1):
                sq = 5 if sk < 4096 else 2
                x = torch.randn(2, 3, sq, sk, device="cuda", generator=g).to(dtype)
                keep = torch.rand(2, 1, sq, sk, device="cuda", generator=g) > 0.3
                keep[0, :, 0] = False  # fully masked row
                add = torch.randn(1, 1, 1, sk, device="cuda", generator=g).to(dtype)
                for causal, mask in ((True, None), (False, keep), (True, add)):
                    out = torch.full_like(x, float("nan"))
                    scaled_masked_softmax(x, 0.3, causal=causal, attn_mask=mask, out=out, version=version)
                    want = reference.scaled_masked_softmax(x, 0.3, causal=causal, attn_mask=mask)
                    assert_close(out, want, softmax_tolerance(want.double(), scores_of(x, 0.3, causal, mask), dtype),
                                 f"sk={sk} {dtype} v{version} causal={causal}")
                    cases += 1
                    if version == 1:  # the backward kernel (its launch classes follow sk too)
                        dy = torch.randn(x.shape, device="cuda", generator=g).to(dtype)
                        dx = scaled_masked_softmax_backward(dy, out, 0.3, causal=causal)
                        want_dx = reference.scaled_masked_softmax_backward(dy, out, 0.3, causal=causal)
                        assert_close(dx, want_dx, 1e-5 + 2e-2 * want_dx.abs().double(),
                                     f"backward sk={sk} {dtype} causal={causal}")
                        cases += 1
    x = torch.randn(4, 7, 5, device="cuda")[..., 1:]  # misaligned, scalar path
    scaled_masked_softmax(x, causal=True)
    return cases + 1


# (cache shape, lengths and options) of decode_attention; each checked against the float64 reference with
# NaN in every cache slot it must not read (tests/test_decode_attention.py's run_and_check). RAGGED_CASES:
# packed rows with cu_seqlens_q (tests/test_decode_attention_ragged.py's run_and_check).
DECODE_CASES = [
    dict(batch=3, nheads_kv=2, group=4, headdim=128, max_len=300, seqlens=[0, 1, 290], seqlen_new=4,
         leftpad=[0, 1, 7], num_splits=3, dtype=torch.float16),
    dict(batch=2, nheads_kv=1, group=8, headdim=256, max_len=200, seqlens=[199, 50], seqlen_new=1, append=True,
         num_splits=7, dtype=torch.bfloat16),
    dict(batch=2, nheads_kv=4, group=1, headdim=32, max_len=70, seqlens=[3, 54], seqlen_new=16, num_splits=64,
         leftpad=[2, 0], dtype=torch.float32, cache_layout="bshd", qkv="fused"),
    dict(batch=2, nheads_kv=2, group=2, headdim=64, max_len=40, seqlens=[5, 40], append=False, num_splits=256,
         dtype=torch.float32, use_out=True),
    dict(batch=1, nheads_kv=1, group=16, headdim=96, max_len=1000, seqlens=[997], seqlen_new=3, num_splits=None,
         dtype=torch.float16),
    dict(batch=2, nheads_kv=2, group=1, headdim=80, max_len=64, seqlens=[0, 0], seqlen_new=2, append=False,
         num_splits=1, dtype=torch.bfloat16),
]
RAGGED_CASES = [
    # the tensor-core kernel with idle rows (max_seqlen_q 8 > every n_b) and a zero-length sequence, the combine
    dict(new=[3, 0, 1, 5], seqlens=[0, 7, 299, 200], max_len=300, nheads_kv=2, group=4, headdim=128, extra=3,
         num_splits=64, leftpad=[0, 7, 5, 0], dtype=torch.float16, use_out=True, qkv="fused"),
    # the CUDA-core kernel over a paged cache, a cache filled by the append, splits in a cluster
    dict(new=[2, 6], seqlens=[62, 10], max_len=64, nheads_kv=1, group=3, headdim=32, paged=True, num_splits=3,
         dtype=torch.float32, key_mask=0.5),
]


# decode_attention over a paged cache (tests/test_decode_attention_paged.py's run_and_check: the pages handed
# out in random order, every pool row no sequence owns NaN; the append checked bit for bit). Splits of many
# tiles (the pages looked up a tile ahead, the L2 prefetch through the table), an append across a page
# boundary in each case (slots seqlens .. seqlens + seqlen_new - 1 straddle a multiple of page_size), split
# boundaries inside a page (whole tiles of 16 / 64 slots, pages of 256), the CUDA-core kernel (rows < 4) and
# the tensor-core one (GQA, rows >= 4), float32, token-major (nhd) pools, unused entries -1 or past the pool.
PAGED_DECODE_CASES = [
    dict(batch=2, nheads_kv=2, group=1, headdim=128, page_size=16, max_len=1024, seqlens=[1006, 318],
         seqlen_new=3, leftpad=[0, 5], num_splits=3, dtype=torch.float16),
    dict(batch=1, nheads_kv=2, group=4, headdim=128, page_size=256, max_len=768, seqlens=[510], seqlen_new=3,
         num_splits=5, dtype=torch.bfloat16),
    dict(batch=3, nheads_kv=1, group=8, headdim=64, page_size=16, max_len=512, seqlens=[0, 207, 495],
         seqlen_new=2, leftpad=[0, 3, 190], num_splits=7, dtype=torch.float16, pool_layout="nhd",
         unused_entry="past_the_pool"),
    dict(batch=2, nheads_kv=2, group=1, headdim=64, page_size=256, max_len=768, seqlens=[255, 700], seqlen_new=2,
         num_splits=3, dtype=torch.float32, spare_pages=3),
    dict(batch=2, nheads_kv=1, group=2, headdim=256, page_size=16, max_len=160, seqlens=[15, 150], seqlen_new=2,
         num_splits=2, dtype=torch.float32, use_out=True),
    dict(batch=2, nheads_kv=2, group=1, headdim=32, page_size=16, max_len=256, seqlens=[31, 200], seqlen_new=2,
         num_splits=None, dtype=torch.float16, key_mask=0.5),
]


def paged_decode_cases(quick: bool) -> int:
    """PAGED_DECODE_CASES, then block_table entries out of [0, num_pages) among the pages a sequence reads or
    writes (NaN outputs, no page written for it, no address outside the pool: a split other than the first reads
    through the entry clamped into the pool) beside an in-range sequence, on the CUDA-core and tensor-core
    kernels, one split, splits merged in a cluster and through the combine kernel."""
    from fused_attn.decode_attention import decode_attention
    from tests.test_decode_attention_paged import appended_pool, paged_case_of
    from tests.test_decode_attention_paged import run_and_check as paged_run_and_check

    cases = 0
    for i, kw in enumerate(PAGED_DECODE_CASES[:2] if quick else PAGED_DECODE_CASES):
        paged_run_and_check(paged_case_of(seed=i, **kw), "cuda")
        cases += 1
    ps, max_blocks, hkv, d, sn, b = 16, 16, 2, 64, 3, 4
    num_pages = b * max_blocks
    for group, num_splits in ((1, 3), (4, 1), (8, 3), (1, 20), (8, 20)):
        g = torch.Generator(device="cuda").manual_seed(group)
        k_pool = torch.randn(num_pages, hkv, ps, d, generator=g, device="cuda").half()
        v_pool = torch.randn(num_pages, hkv, ps, d, generator=g, device="cuda").half()
        q = torch.randn(b, hkv * group, sn, d, generator=g, device="cuda").half()
        kn, vn = (torch.randn(b, hkv, sn, d, generator=g, device="cuda").half() for _ in range(2))
        table = torch.arange(num_pages, dtype=torch.int32).view(b, max_blocks)
        table[1, 10] = -5  # a page read (slots 160-175: past the first of 3 splits), below the pool
        table[2, 12] = num_pages  # the append's page (slots 200-202), past the pool
        table[3, 15] = 2**31 - 1  # a block sequence 3 never touches: computed
        table = table.cuda()
        lengths = [200, 200, 200, 200]
        k0, v0 = k_pool.clone(), v_pool.clone()
        out = decode_attention(q, k_pool, v_pool, torch.tensor(lengths, dtype=torch.int32, device="cuda"), k_new=kn,
                               v_new=vn, num_splits=num_splits, block_table=table)
        good = [0, 3]
        assert out[1].isnan().all() and out[2].isnan().all(), f"group {group}: out-of-range pages give NaN"
        assert not out[good].isnan().any(), f"group {group}: in-range sequences computed"
        k_want = appended_pool(k0, kn[good], table[good], [lengths[i] for i in good], ps)
        v_want = appended_pool(v0, vn[good], table[good], [lengths[i] for i in good], ps)
        assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want), f"group {group}: only in-range appends"
        cases += 1
    return cases


def decode_cases(quick: bool) -> int:
    from fused_attn.decode_attention import decode_attention

    cases = 0
    for i, kw in enumerate(DECODE_CASES[:3] if quick else DECODE_CASES):
        run_and_check(case_of(seed=i, **kw), "cuda")
        cases += 1
    for i, kw in enumerate(RAGGED_CASES):
        ragged.run_and_check(ragged.ragged_case_of(seed=i, **kw), "cuda")
        cases += 1
    cases += paged_decode_cases(quick)
    # out-of-bounds device lengths (past max_len - seqlen_new, negative, leftpad past the length): NaN, no access
    q = torch.randn(4, 4, 3, 64, device="cuda", dtype=torch.float16)
    k, v = torch.randn(4, 2, 32, 64, device="cuda", dtype=torch.float16), torch.randn(4, 2, 32, 64, device="cuda",
                                                                                      dtype=torch.float16)
    kn = torch.randn(4, 2, 3, 64, device="cuda", dtype=torch.float16)
    seqlens = torch.tensor([30, -5, 2**31 - 1, 4], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 0, 0, 9], dtype=torch.int32, device="cuda")
    k0 = k.clone()
    out = decode_attention(q, k, v, seqlens, k_new=kn, v_new=kn.clone(), cache_leftpad=leftpad, num_splits=4)
    assert out.isnan().all() and torch.equal(k, k0), "out-of-bounds lengths"
    # out-of-range device offsets (n_b past max_seqlen_q, decreasing, past total_q): no append, no row outside q's
    cu = torch.tensor([0, 5, 4, 9, 40], dtype=torch.int32, device="cuda")
    q, kn = torch.randn(6, 4, 64, device="cuda", dtype=torch.float16), torch.randn(6, 2, 64, device="cuda",
                                                                                   dtype=torch.float16)
    decode_attention(q, k, v, torch.tensor([4, 4, 4, 4], dtype=torch.int32, device="cuda"), k_new=kn,
                     v_new=kn.clone(), cu_seqlens_q=cu, max_seqlen_q=3, num_splits=4)
    assert torch.equal(k, k0), "out-of-range offsets"
    return cases + 2


def norm_cases(quick: bool) -> int:
    """layer_norm / rms_norm against the float64 reference (tests/test_layer_norm.py's run_and_check): a width
    per row class (the scalar path at odd widths), 37 rows (a partly filled last block of short rows)."""
    from tests.test_layer_norm import case_of as norm_case_of
    from tests.test_layer_norm import run_and_check as norm_run_and_check

    widths = (65, 768, 4096, 16384) if quick else (64, 65, 128, 200, 256, 512, 768, 769, 1024, 2048, 4095, 4096,
                                                     8192, 16383, 16384)
    cases = 0
    for i, width in enumerate(widths):
        for rms in (False, True):
            layout = ("contiguous", "misaligned", "strided_rows")[i % 3]
            norm_run_and_check(norm_case_of(rows=37, width=width, rms=rms, bias=None if rms else "float32",
                                            layout=layout, dtype=(torch.float16, torch.bfloat16, torch.float32)[i % 3],
                                            seed=i), "cuda")
            cases += 1
    # Gathered rows (x_index / residual_index): repeats, indices below 0 and past the tables (NaN rows that
    # must read nothing), an empty table, int32 and int64 indices (tests/test_layer_norm.py's examples).
    from tests.test_layer_norm import GATHER_EXAMPLES, run_and_check_gathered

    for example in GATHER_EXAMPLES[:2] if quick else GATHER_EXAMPLES:
        run_and_check_gathered(example, "cuda")
        cases += 1
    return cases


# attention cases (tests/test_attention.py's check_case: float64 reference, out poisoned with NaN).
ATTENTION_CASES = [
    dict(sq=97, sk=131, d=32, causal=True, mask="bool_key"),
    dict(sq=130, sk=61, d=64, causal=True, mask="additive_full", group=4, hkv=1, layout="fused_qkv"),
    dict(sq=65, sk=200, d=128, mask="bool_head", share=1.0, dtype=torch.bfloat16),
    dict(sq=33, sk=70, d=256, causal=True, mask="additive_query"),
    # mode "flash" is the wgmma kernel on Hopper at d 64 / 128; the mma.sync one stays covered there
    dict(sq=300, sk=457, d=128, causal=True, mode="flash_mma", group=2),
    dict(sq=300, sk=457, d=128, causal=True, group=2, dtype=torch.bfloat16),
    dict(sq=31, sk=47, d=40, mode="naive", mask="bool_full", dtype=torch.float32, causal=True),
    dict(sq=70, sk=33, d=24, mode="tiled", mask="additive_key", dtype=torch.float16, layout="fused_qkv"),
]


# The wgmma kernel's loaders (attention_heuristics.h): TMA where q, k and v can be described as tensor maps,
# cp.async where they cannot (layout kv_broadcast: k and v repeat one kv head, stride 0): a partial last key
# tile and query tile, a padded head dim, GQA through the kv head coordinate.
ATTENTION_LOADER_CASES = [
    dict(sq=300, sk=457, d=128, causal=True, group=2, mode="flash_wgmma"),
    dict(sq=129, sk=65, d=80, mask="bool_key", dtype=torch.bfloat16, mode="flash_wgmma", layout="fused_qkv"),
    dict(sq=300, sk=457, d=128, causal=True, group=2, mode="flash_wgmma", layout="kv_broadcast"),
]


# Head dim 64's wgmma tiles, each chosen by its shape (attention_heuristics.h's flash_d64_tile): tile 2 at a
# grid of at most one 128-row block per SM, tile 1 under causal past it (b=12: 3 x 4 x 12 = 144 blocks, more
# than the 132 SMs of an H100 or H200); partial last query and key tiles, causal, GQA, a padded head dim; tile 2's
# lone consumer with the cp.async loader as well as TMA.
ATTENTION_D64_TILE_CASES = [
    dict(sq=300, sk=457, d=64, causal=True, group=2, b=12, mode="flash_wgmma"),
    dict(sq=197, sk=331, d=56, causal=True, mask="additive_key", mode="flash_wgmma"),
    dict(sq=129, sk=65, d=64, mask="bool_key", dtype=torch.bfloat16, mode="flash_wgmma", layout="kv_broadcast"),
]


def attention_cases(quick: bool) -> int:
    from tests.test_attention import HOPPER, check_case, gcase

    wgmma = [] if quick or not HOPPER else ATTENTION_LOADER_CASES + ATTENTION_D64_TILE_CASES
    cases = (ATTENTION_CASES[:2] if quick else ATTENTION_CASES) + wgmma
    for i, kw in enumerate(cases):
        check_case(gcase(seed=i, **kw))
    return len(cases)


# linear (tests/test_linear.py's run_and_check: poisoned output, against the float64 reference and cuBLAS):
# K with a partial last loop step, N that gives 4 / 2 / 1 weight rows per block, odd K, misaligned rows.
LINEAR_CASES = [
    dict(m=1, k=768, n=2304, activation="gelu_tanh", dtype=torch.float16),
    dict(m=3, k=3080, n=768, activation="swiglu", dtype=torch.bfloat16, layout="misaligned"),
    dict(m=16, k=1000, n=96, activation=None, dtype=torch.float32),
    dict(m=9, k=37, n=5, activation="gelu_tanh", dtype=torch.float16, layout="strided"),
    dict(m=5, k=64, n=200, activation="swiglu", dtype=torch.float16, lead="3d"),
    dict(m=12, k=776, n=2306, activation="swiglu", dtype=torch.bfloat16),  # the tensor-core kernel
    dict(m=7, k=776, n=2305, activation="gelu_tanh", dtype=torch.float16),
    # 9-16 rows in the short build: x staged through shared memory by cp.async (a grid resident at once,
    # a partial last chunk of K and tile of N), and in registers (a grid of many waves)
    dict(m=16, k=744, n=2305, activation="gelu_tanh", dtype=torch.float16),
    dict(m=11, k=744, n=10000, activation=None, dtype=torch.bfloat16),
    # the split-K kernel (sm_90): clusters along K, rank 0 reading the others' sums from their shared memory
    dict(m=16, k=3080, n=776, activation="gelu_tanh", dtype=torch.float16),
    dict(m=13, k=1536, n=768, activation=None, dtype=torch.bfloat16),  # short splits: x staged
    dict(m=6, k=72, n=400, activation="swiglu", dtype=torch.bfloat16, lead="3d"),
    # 17-32 rows: the wide build of both (four n-tiles, the last one partly past m)
    dict(m=25, k=776, n=2305, activation="gelu_tanh", dtype=torch.float16),
    dict(m=32, k=3080, n=776, activation="swiglu", dtype=torch.bfloat16, lead="3d"),
    # 33-64 rows of the split-K shapes: its wide build in two row groups (the second full, or one row)
    dict(m=64, k=3080, n=776, activation="gelu_tanh", dtype=torch.float16),
    dict(m=33, k=768, n=1536, activation="swiglu", dtype=torch.bfloat16, lead="3d"),
]


# linear with norm= (test_linear.py's run_and_check_norm): the same launch classes with the prologue,
# float32 rows of 48 KB (16 x 768), a zero-variance row, and the fallback above 64 KB of rows.
LINEAR_NORM_CASES = [
    dict(m=1, k=768, n=2304, dtype=torch.float16),  # GPT-2's ln_1 + c_attn at B1
    dict(m=3, k=3080, n=768, activation="swiglu", dtype=torch.bfloat16, layout="misaligned", norm="rms_norm",
         norm_bias=False),
    dict(m=16, k=768, n=96, dtype=torch.float32, affine_fp32=True),
    dict(m=9, k=37, n=5, activation="gelu_tanh", dtype=torch.float16, layout="strided", magnitude="constant"),
    dict(m=12, k=776, n=2306, activation="swiglu", dtype=torch.bfloat16),  # the tensor-core kernel
    dict(m=7, k=776, n=2305, dtype=torch.float16, magnitude="offset"),
    dict(m=16, k=2048, n=64, dtype=torch.float32),  # 128 KB of rows: layer_norm's kernel, then the plain one
    # the weight and bias read from global memory after the statistics (not 16-byte aligned: not staged)
    dict(m=1, k=768, n=2304, dtype=torch.float16, affine_misaligned=True),
    dict(m=16, k=768, n=2304, dtype=torch.bfloat16, affine_misaligned=True),
]


# linear with a weightless norm at one 16-bit row: the fold into the dot products (test_linear.py's
# test_norm_fold_one_row_gpu: k, n, activation, dtype, norm, row kind), the 16-byte and element-wise paths.
LINEAR_FOLD_CASES = [
    (768, 2304, None, torch.float16, "layer_norm", "randn"),
    (1001, 96, "gelu_tanh", torch.bfloat16, "rms_norm", "outlier_first"),
    (768, 40, "swiglu", torch.float16, "layer_norm", "constant"),
]


# linear with a weightless norm at 4-16 16-bit rows: layer_norm's launch, then the tensor-core kernel
# (test_linear.py's test_weightless_norm_rows_gpu: k, n, activation, dtype, norm, rows); 16 float16 rows
# include one spanning float16's range.
LINEAR_NORM_ROWS_CASES = [  # k, n, activation, dtype, norm, rows, row kinds (test_weightless_norm_rows_gpu's)
    (768, 3072, "gelu_tanh", torch.float16, "layer_norm", 8, "plain"),  # the self-normalizing kernel
    (768, 2304, None, torch.bfloat16, "layer_norm", 5, "mixed"),  # the same, its redo pass
    (768, 2304, None, torch.float16, "layer_norm", 16, "mixed"),
    (1000, 4400, "swiglu", torch.bfloat16, "rms_norm", 9, "mixed"),
]


def linear_cases(quick: bool) -> int:
    from tests.test_linear import case_of as linear_case_of
    from tests.test_linear import check_weightless_norm, fold_rows, norm_case_of, plain_rows, run_and_check_norm
    from tests.test_linear import test_norm_fold_one_row_gpu, weightless_norm_inputs
    from tests.test_linear import run_and_check as linear_run_and_check

    # racecheck (quick) takes the staged-x tensor-core case and the small split-K case: the 16-row K 3080
    # one's and the staged split-K one's cuBLAS peers (the test's error reference) run cuBLAS kernels in
    # which racecheck reports hazards that are not ours (nvjet_*_splitK; nvjet_sm90_tst_8x64_64x16_4x1_v_bz_bias_TNN).
    cases = [LINEAR_CASES[i] for i in (0, 1, 5, 7, 11)] if quick else LINEAR_CASES
    for i, kw in enumerate(cases):
        linear_run_and_check(linear_case_of(seed=i, **kw), "cuda")
    norm_cases = [LINEAR_NORM_CASES[0], LINEAR_NORM_CASES[4]] if quick else LINEAR_NORM_CASES
    for i, kw in enumerate(norm_cases):
        run_and_check_norm(norm_case_of(seed=i, **kw), "cuda")
    fold_cases = LINEAR_FOLD_CASES[:1] if quick else LINEAR_FOLD_CASES
    for args in fold_cases:
        test_norm_fold_one_row_gpu(*args)
    norm_rows_cases = LINEAR_NORM_ROWS_CASES[:2] if quick else LINEAR_NORM_ROWS_CASES
    for k, n, act, dtype, norm, m, rows in norm_rows_cases:
        gen = torch.Generator().manual_seed(k + n + m)
        x = (fold_rows if rows == "mixed" else plain_rows)(m, k, dtype, gen)
        check_weightless_norm(*weightless_norm_inputs(x, n, act, norm, gen), act, norm)
    return len(cases) + len(norm_cases) + len(fold_cases) + len(norm_rows_cases)


# sample: (rows, vocab, dtype, layout, temperature, offsets): one block per row (vocab <= 4096), clusters of
# 2, 3 and 8 blocks, a misaligned head and a tail in every block, rows read through a stride, per-row offsets.
SAMPLE_CASES = [
    dict(rows=3, vocab=7, dtype=torch.float32, layout="contiguous", temperature=0.0),
    dict(rows=16, vocab=50257, dtype=torch.float16, layout="contiguous", temperature=1.0, offsets="per_row",
         top_k=50),  # the radix select: histograms read across the cluster
    dict(rows=5, vocab=4097, dtype=torch.bfloat16, layout="misaligned", temperature=0.0, kind="ties"),
    dict(rows=4, vocab=33000, dtype=torch.float32, layout="strided_rows", temperature=0.7, offsets="one",
         top_k=1000),
    dict(rows=2, vocab=128256, dtype=torch.float16, layout="transposed", temperature=0.0, kind="nan"),
    # 64 rows of GPT-2's logits: clusters of 3 blocks where the device holds fewer than 64 of 4 (an H200)
    dict(rows=64, vocab=50257, dtype=torch.float16, layout="misaligned", temperature=0.0, kind="ties"),
]


def sample_cases(quick: bool) -> int:
    from tests.test_sample import case_of as sample_case_of
    from tests.test_sample import check_case, check_history, history_case_of

    cases = SAMPLE_CASES[:2] if quick else SAMPLE_CASES
    for i, kw in enumerate(cases):
        check_case(sample_case_of(data_seed=i, seed=i, offset=3 * i, **kw), "cuda")
    # the token history (history= / history_index=, the index one of advance's rows, some out of range)
    check_history(history_case_of(data_seed=7, rows=16, vocab=50257, dtype=torch.float16), "cuda")
    return len(cases) + 1


def qkv_cases(quick: bool) -> int:
    from tests.test_qkv_decode_attention import (check_against_chain,
                                                 test_lengths_out_of_bounds_give_nan_and_leave_the_cache_gpu)

    shapes = [(1, 768, 300), (3, 256, 40), (16, 768, 70)] if quick else \
        [(1, 768, 300), (3, 256, 40), (2, 1024, 70), (3, 768, 9), (16, 768, 70), (13, 512, 33)]
    for i, (batch, d, max_len) in enumerate(shapes):
        check_against_chain("cuda", torch.float16 if i % 2 == 0 else torch.bfloat16, batch, d, max_len, seed=i,
                            leftpad=i != 1)
    for batch in (3, 11):
        test_lengths_out_of_bounds_give_nan_and_leave_the_cache_gpu(batch)
    return len(shapes) + 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
