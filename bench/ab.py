"""A/B timing of code variants against the tree as it is, in one GPU run.

    python -m bench.ab --list                                  # the named variants and what they measured
    python -m bench.ab decode-wide-from-8                      # against the default, bench.time_decode_graph
    python -m bench.ab flash-tma-off --cmd "python3 -m pytest bench/bench_attention.py -k causal" --repeat 2
    python -m bench.ab pdl-early-all --no-default --cmd "python3 -m pytest -q -m gpu tests/test_gpt2.py"
    git archive REV | (mkdir -p .ab-trees/old && tar -x -C .ab-trees/old)   # another commit, as a tree ...
    python -m bench.ab --tree old=.ab-trees/old --cmd "..." --repeat 3       # ... timed beside this one

A variant is a list of edits (file, anchor, replacement); each anchor must occur exactly once in its file, as
tests/mutations.py's anchors must. Each variant, and the default (no edit), gets its own copy of the
repository under --workdir (the files git tracks plus the untracked ones it does not ignore:
tests.mutations.copy_repo), its own library cache (FUSED_ATTN_CACHE beside the copy) and its own build; then
the command runs in each copy in turn, --repeat rounds interleaved, and one table prints each case's time
per variant beside the default's. The checkout is only read. A copy keeps its path and its files' times
between calls, so a second call rebuilds only what its edits touch. --tree NAME=DIR adds another tree of the
project (a commit exported with git archive, say, or a git work tree) as a variant of its own: the same command,
the same interleaved rounds, so two commits are compared in one process each, in one device run.

Times are read from the command's output: lines "<case>: <time> us" (bench.time_decode_graph prints one a
case), or for a pytest command pytest-benchmark's JSON (this script adds --benchmark-json): each case's
extra_info p50_us, else its median. A command without times (a test run) reports its exit status and last
line, which is how a variant's correctness is checked on the GPU.

VARIANTS is the record of what was measured: each names its edits and the measurement that left the default
where it is. A new experiment is a new entry (an edit of the heuristics tables, or of a kernel), never a
macro or an environment switch in the shipped code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.mutations import copy_repo, replace_once

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "default"
DEFAULT_CMD = "python3 -m bench.time_decode_graph"
DEFAULT_WORKDIR = Path("/tmp/fused_attn_ab")


@dataclass(frozen=True)
class Edit:
    path: str  # relative to the repository root
    old: str   # the anchor: exactly once in the file
    new: str


@dataclass(frozen=True)
class Variant:
    name: str
    edits: tuple[Edit, ...]
    measured: str = ""  # the measurement that chose the default over this variant
    cmd: str = field(default=DEFAULT_CMD)  # the command it was measured with


ATTN_H = "csrc/attention/attention_heuristics.h"
DECODE_H = "csrc/decode_attention/decode_attention_heuristics.h"
DECODE_K = "csrc/decode_attention/decode_attention_kernel.cuh"
PDL_H = "csrc/common/pdl.cuh"
PDL_ROWS = "constexpr long kPdlEarlyRows = 8;"
PDL_NORM_ROWS = "constexpr long kPdlEarlyNormRows = 16;"
WIDE = "constexpr int64_t kDecodeWideMinBatch = 16;"
WIDE_MAX = "constexpr int64_t kDecodeWideMaxBatch = 16;"
NEVER = "int64_t(1) << 40"
# The long-cache rule's count, both layouts: the split count whose last round of resident blocks is fullest.
LONG_FILL = "  return decode_long_fill_splits(work, sms, splits);"
# The tensor-core decode kernel's loop: the barrier after tile t landed, the next tile's copies, Q·Kᵀ's end.
# The linear kernels' wide build (17-32 rows).
LINEAR_H = "csrc/linear/linear_heuristics.h"
WIDE_CHUNKS = "constexpr int kMmaWideChunks = 1;"
WIDE_CMD = "python3 -m bench.time_decode_graph --backends graph-fused --batches 24,32,48,64 --reps 5"

SAMPLE_K = "csrc/sample/sample_kernel.cuh"
SAMPLE_H = "csrc/sample/sample_heuristics.h"
SAMPLE_FIT = "  while (blocks > 1 && rows > int64_t(clusters_at_once(int(blocks)))) --blocks;\n"
SAMPLE_PIECES = "constexpr int U = 2;  // pieces in flight per thread before any is used"
SAMPLE_GREEDY_LOOP_START = ("    const int64_t a0 = k.a0, pieces = k.pieces;\n"
                            "    constexpr int U = 2;  // pieces in flight per thread before any is used\n")
SAMPLE_GREEDY_COLUMN = (
    "          if (kDraw && (e == 0 || c % 4 == 0)) w = rng.draw(c / 4);  // a new Philox group\n"
    "          const unsigned long long key = pack(score(to_float(piece[u].v[e]), word(w, int(c % 4))), c);\n"
    "          best = key > best ? key : best;\n"
    "        }\n"
    "      }\n"
    "    }\n")
SAMPLE_GREEDY_COLUMN_OWN = (
    "          if constexpr (kDraw) {\n"
    "            if (e == 0 || c % 4 == 0) w = rng.draw(c / 4);  // a new Philox group\n"
    "            const unsigned long long key = pack(score(to_float(piece[u].v[e]), word(w, int(c % 4))), c);\n"
    "            best = key > best ? key : best;\n"
    "          } else {  // the columns rise within a thread: a strict > keeps the first of equal keys\n"
    "            const uint32_t key = order_key(piece[u].v[e]);\n"
    "            if (key > gkey) gkey = key, gcol = uint32_t(c);\n"
    "          }\n"
    "        }\n"
    "      }\n"
    "    }\n"
    "    if constexpr (!kDraw) {  // every key is >= 1 (order_key): 0 is no column\n"
    "      if (gkey > 0) best = (static_cast<unsigned long long>(gkey) << 32) | (0xFFFFFFFFu - gcol);\n"
    "    }\n")
SAMPLE_GREEDY_SCALARS = "      const unsigned long long key = pack(score(to_float(logits[c]), bits), c);\n"
SAMPLE_GREEDY_SCALARS_OWN = (
    "      const unsigned long long key =\n"
    "          kDraw ? pack(score(to_float(logits[c]), bits), c)\n"
    "                : (static_cast<unsigned long long>(order_key(logits[c])) << 32) |\n"
    "                      (0xFFFFFFFFu - static_cast<uint32_t>(c));\n")
SAMPLE_STEP_CMD = "python3 -m bench.time_decode_graph --backends graph-fused --batches 16,32,48,64 --reps 5"

MMA_TILE_LANDED = "    __syncthreads();  // tile t landed for every thread; the stage tile t - 1 used is free\n"
MMA_ISSUE_NEXT = "    if (t + STAGES - 1 < n_tiles) issue(t + STAGES - 1);\n    cp_async_commit();\n"
MMA_QK_END = "      mma16816<T>(s[1], qa[kk], kf[2], kf[3]);\n    }\n"

_VARIANTS = [
    Variant("flash-tma-off", (Edit(ATTN_H, "constexpr bool kFlashTma = true;", "constexpr bool kFlashTma = false;"),),
            "the cp.async loader everywhere: 1.5-1.7x slower than TMA at D128 S4096 (fp16, H100)",
            "python3 -m pytest bench/bench_attention.py -k fused_flash"),
    Variant("flash-d64-tile2-always",
            (Edit(ATTN_H, "return causal && blocks_128 > sms ? 1 : 2;",
                  "return false && causal && blocks_128 > sms ? 1 : 2;"),),
            "tile 2 also for causal grids past one 128-row block per SM: B8 H12 causal S512 / S1024 39.1 / 83.9 us "
            "against tile 1's 35.3 / 76.8 (fp16, H100)",
            "python3 -m pytest bench/bench_attention.py -k fused_flash"),
    Variant("flash-order-natural",
            (Edit(ATTN_H, "constexpr int64_t kFlashLongestFirstMaxWaves = 8;",
                  "constexpr int64_t kFlashLongestFirstMaxWaves = 0;"),),
            "each (head, batch)'s causal tiles in turn: B8 H12 S512 D64 35.2 us against longest-first's 30.7, "
            "H32 D128 S2048 / S4096 +8% / +2..6% (H100)",
            "python3 -m pytest bench/bench_attention.py -k causal"),
    Variant("flash-order-longest",
            (Edit(ATTN_H, "constexpr int64_t kFlashLongestFirstMaxWaves = 8;",
                  f"constexpr int64_t kFlashLongestFirstMaxWaves = {NEVER};"),),
            "longest-first past 8 waves too: H32 D128 S16384 causal +4..7% (H100)",
            "python3 -m pytest bench/bench_attention.py -k causal"),
    Variant("decode-prefetch-whole-split",
            (Edit(DECODE_H, "constexpr int kDecodePrefetchMaxSlots = 128;",
                  "constexpr int kDecodePrefetchMaxSlots = 1 << 30;"),),
            "every cached slot of a block's split prefetched into L2 before the PDL wait (the bound's alternative)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'fused- and b1-hq32 and float16'"),
    Variant("decode-paged-check-one-entry-at-a-time",
            (Edit(DECODE_H, "constexpr int kDecodePagesInFlight = 8;", "constexpr int kDecodePagesInFlight = 1;"),),
            "a paged cache's entries checked one 16-byte load (four entries) at a time by the first split (4 "
            "dependent L2 round trips a thread at 32k keys in pages of 16, 16 at 128k): not yet measured",
            "python3 -m pytest bench/bench_decode_attention.py -k 'float16 and (paged- or fused-)'"),
    Variant("decode-paged-no-check",
            (Edit(DECODE_K, "      return !__syncthreads_or(r.last > r.first && worst >= uint32_t(p.num_pages));",
                  "      (void)worst;\n      return true;"),),
            "the tensor-core kernel's first split does not check its sequence's block_table entries (unsafe: the "
            "bound on what the check costs, not a candidate). Before the first split alone checked, every block "
            "checked all of them before its first tile; that check against none: paged B1 GQA 32/8 D64 128k keys "
            "99.1 -> 81.5 us (contiguous 82.5); B4 32k 91.0 -> 79.4 (77.8); B16 32k 290.1 -> 261.1 (258.5) (H200, "
            "fp16, pages of 16). The first split alone checking after its first tiles were issued, before its loop, "
            "against none (2026-11-30): B1 64/8 D64 8k 18.8 -> 17.7 us, 32/8 D128 8k 22.6 -> 22.0, B4 32/8 D128 "
            "32k 137.9 -> 134.7 (contiguous 15.9 / 21.0 / 135.6); since then its first 512 entries are staged "
            "before the loop and compared after it (PageCheck)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'float16 and (paged- or fused-) and hkv8'"),
    Variant("decode-mma-d128-two-stages",
            (Edit(DECODE_K, "static constexpr int STAGES = kStageBytes <= 16384 ? 4 : 3;",
                  "static constexpr int STAGES = kStageBytes <= 16384 ? 4 : 2;"),),
            "the tensor-core kernel at head dim 128 with two 32 KB stages (68 KB: three blocks an SM) instead of three "
            "(100 KB: two): GQA 32/8 and 64/8 D128, batch 1 / 4 / 16, 8k-128k keys, contiguous 0.953-1.033x the "
            "default, paged 0.971-1.052x, paged slower in 14 of 18 (H200, fp16, two interleaved rounds, 2026-11-30)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'not bfloat16 and (fused- or paged-) and "
            "hkv8 and d128 and (l8192- or l32768- or l131072-)'"),
    Variant("decode-mma-issue-after-qk",
            (Edit(DECODE_K, MMA_TILE_LANDED + MMA_ISSUE_NEXT, MMA_TILE_LANDED),
             Edit(DECODE_K, MMA_QK_END, MMA_QK_END + MMA_ISSUE_NEXT)),
            "the tensor-core kernel's copies of tile t + STAGES - 1 issued after tile t's Q·Kᵀ mma instead of "
            "before its ldmatrix: the copies' address math under the mma chain's latency at one warp a scheduler "
            "(nvcc 13.0, fp16 D64: main loop 733 -> 750 SASS instructions contiguous, 835 -> 879 paged). Predicted "
            "B1 GQA 8k -0.2..-0.5 us in both layouts; measured even: GQA 32/8 and 64/8, D64 / D128, B1 / B4, 8k / "
            "32k keys, contiguous 0.996-1.014x the default, paged 0.980-1.035x, B1 32/8 D64 8k 1.016x paged, "
            "1.014x contiguous (H200, fp16, two interleaved rounds, 2026-12-01)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'not bfloat16 and (fused- or paged-) and "
            "hkv8 and (l8192- or l32768-)'"),
    Variant("linear-wide-two-chunks", (Edit(LINEAR_H, WIDE_CHUNKS, "constexpr int kMmaWideChunks = 2;"),),
            "the wide build (17-32 rows) with two chunks of 32 k a warp in flight (104-116 registers, no spills): "
            "GPT-2's graph-fused step B32 375.5 -> 373.1 us (0.994, predicted -10..-25 us), B64 even (H200, fp16, "
            "prompt 128, two interleaved rounds, 2026-12-02): within the call's spread, so the fewer registers stay",
            WIDE_CMD),
    Variant("stream-l2-evict-first",
            (Edit("csrc/common/mma.cuh",
                  '  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"\n'
                  '      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)\n'
                  '      : "l"(ptr));\n',
                  '  uint64_t policy;\n'
                  '  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));\n'
                  '  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"\n'
                  '      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)\n'
                  '      : "l"(ptr), "l"(policy));\n'),),
            "the weight stream's loads (load_stream: the linear and qkv_decode_attention kernels) marked evict-first "
            "in L2, so that the step's 248 MB of weights (GPT-2 small, fp16) do not push the K / V caches and the "
            "activations out of L2 between tokens: in dev.probe_megakernel_layers the same hint on the weights' "
            "copies took 12 layers 287.1 -> 262.0 us (H200, 2026-12-01). Predicted GPT-2's graph-fused step at batch 1 "
            "-2..-4%, batch 16 -1..-3%; measured even: batch 1 191.8 -> 191.1 us (0.997), batch 16 271.0 -> 270.2 "
            "(0.997) (H200, fp16, prompt 128, two interleaved rounds, 2026-12-01)",
            "python3 -m bench.time_decode_graph --backends graph-fused --batches 1,16 --reps 5"),
    Variant("cp-async-l2-prefetch-256b",
            (Edit("csrc/common/mma.cuh",
                  'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"',
                  'asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\\n"'),),
            "every cp.async past L1 (the decode kernels' K and V, the flash and linear kernels' tiles) asks L2 to "
            "fetch the 256-byte block around its 16 bytes: predicted 0-2% faster at the long cases where cuDNN "
            "leads; measured slower everywhere: contiguous 1.05-1.09x the default at batch 4 / 16 (GQA D128, MHA "
            "D64 / D128, 8k-128k keys), 1.02-1.07x at batch 1 MHA, paged 1.01-1.05x (H200, fp16, two interleaved "
            "rounds, 2026-11-30)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'not bfloat16 and (fused- or paged-) and "
            "(b4- or b16-) and (l32768- or l131072-)'"),
    Variant("decode-paged-long-splits-off",
            (Edit(DECODE_H, "constexpr int kDecodePagedLongMinLen = 32768;",
                  "constexpr int kDecodePagedLongMinLen = kDecodeLongMinLen;"),),
            "a paged cache's CUDA-core launches on the long-cache rule only from 128k keys, as the contiguous "
            "cache's: the numbers at kDecodePagedLongMinLen in decode_attention_heuristics.h",
            "python3 -m dev.sweep_decode_splits --shapes 1,32,32,128,32768 1,32,32,64,32768 --layouts paged:16 "
            "--splits 8,24"),
    Variant("decode-wave-splits-off",
            (Edit(DECODE_H, "constexpr int kDecodeWaveMinLen = 32768;", "constexpr int kDecodeWaveMinLen = 1 << 30;"),),
            "the CUDA-core kernel's general rule (one split) where its unsplit grid fills the GPU at a long cache "
            "(batch 16 MHA, 32k keys and more): the numbers at kDecodeWaveSplits in decode_attention_heuristics.h",
            "python3 -m dev.sweep_decode_splits --shapes 16,32,32,128,32768 16,32,32,128,131072 --splits 1,16"),
    Variant("decode-long-splits-off",
            (Edit(DECODE_H, "constexpr int kDecodeLongMinLen = 131072;",
                  "constexpr int kDecodeLongMinLen = 1 << 30;"),),
            "the CUDA-core kernel's general rule at 128k keys too (batch 1 MHA: 8 splits in a cluster): B1 32/32 "
            "D128 513.1 us against 24 splits' 494.5, D64 261.3 against 253.0 (H200, fp16, forced num_splits)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'fused- and b1-hq32-hkv32 and l131072'"),
    Variant("decode-long-six-blocks-an-sm",
            (Edit(DECODE_H, LONG_FILL, "  return splits;"),),
            "the long-cache rule at six blocks an SM, both layouts (24 splits at B1 MHA 32 heads, 128k keys) "
            "instead of the count whose last round of resident blocks is fullest (20), contiguous: D128 493.1 / "
            "493.3 us against 489.5 / 488.8, D64 253.5 against 250.3 (H200, fp16, forced num_splits, two sweeps, "
            "2026-11-30)",
            "python3 -m dev.sweep_decode_splits --shapes 1,32,32,128,131072 1,32,32,64,131072 --splits 20,24"),
    Variant("decode-paged-long-six-blocks-an-sm",
            (Edit(DECODE_H, LONG_FILL, "  return paged ? splits : decode_long_fill_splits(work, sms, splits);"),),
            "a paged cache's long-cache rule at six blocks an SM (24 splits at B1 MHA 32 heads) instead of the "
            "fullest last round (20): paged D128 32k 131.3 us against 130.9, D64 32k 70.9 / 70.6, D64 128k 248.7 / "
            "247.8, D128 128k 486.3 / 483.6; contiguous and the other paged cases unchanged (H200, fp16, bench.ab, "
            "two interleaved rounds, 2026-12-01; forced num_splits, D128 128k: 496.4 against 491.6)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'not bfloat16 and (paged- or fused-) and "
            "hkv32 and b1- and (l32768- or l131072-)'"),
    Variant("decode-wide-long-caches",
            (Edit(DECODE_H, "constexpr int64_t kDecodeWideMaxLen = 2048;",
                  f"constexpr int64_t kDecodeWideMaxLen = {NEVER};"),),
            "the 256-thread build at batch >= 16 whatever the cache's length: Llama MHA B16 D128 8k / 32k keys 84.9% / "
            "93.5% of copy bandwidth against the 128-thread build's 102.6% / 104.6% (fp16, H200)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'fused- and b16-hq32 and float16'"),
    Variant("decode-wide-from-8", (Edit(DECODE_H, WIDE, "constexpr int64_t kDecodeWideMinBatch = 8;"),),
            "the 256-thread build from batch 8: GPT-2's B8 step +2..+3 us (H100)",
            "python3 -m bench.time_decode_graph --batches 8,16"),
    Variant("decode-wide-to-24", (Edit(DECODE_H, WIDE_MAX, "constexpr int64_t kDecodeWideMaxBatch = 24;"),),
            "the 256-thread build up to batch 24 (the batches between the measured 16, where it wins, and 32, where "
            "it loses): GPT-2's step B16 270.9 -> 270.6 us, B24 344.0 -> 344.4 (H200, fp16, prompt 128, two "
            "interleaved rounds, 2026-12-02): even, so the bound stays at 16",
            "python3 -m bench.time_decode_graph --backends graph-fused --batches 16,24,32 --reps 5"),
    Variant("decode-wide-every-batch", (Edit(DECODE_H, WIDE, "constexpr int64_t kDecodeWideMinBatch = 1;"),
                                        Edit(DECODE_H, WIDE_MAX, f"constexpr int64_t kDecodeWideMaxBatch = {NEVER};")),
            "every one-row launch not on the deep build on the 256-thread build (the correctness run of the wide "
            "build at every batch)"),
    Variant("decode-wide-off", (Edit(DECODE_H, WIDE, f"constexpr int64_t kDecodeWideMinBatch = {NEVER};"),),
            "no wide build: GPT-2's B16 step +3.3 us at a 128-token prompt, +4.0 at 512 (H200, settled process); "
            "when the wide build ran from batch 16 up, B32 / B48 / B64 374.0 -> 368.6 / 526.1 -> 497.2 / 544.2 -> "
            "516.2 us without it (H200, fp16, prompt 128, two interleaved rounds, 2026-12-02): kDecodeWideMaxBatch",
            "python3 -m bench.time_decode_graph --batches 16"),
    Variant("decode-deep-off",
            (Edit(DECODE_H, "constexpr bool kDecodeDeep = true;", "constexpr bool kDecodeDeep = false;"),),
            "32 KB pipelines only: GPT-2's fp16 B4 step +20 us (+7%), B1 +1 us (H100)",
            "python3 -m bench.time_decode_graph --batches 1,4"),
    Variant("decode-mma-one-row",
            (Edit(DECODE_H, "constexpr int kDecodeMmaMinRows = 4;", "constexpr int kDecodeMmaMinRows = 1;"),),
            "the tensor-core kernel at one row: GPT-2's step +27 to +42 us, Llama B1 H32 L8192 80-88 us against 54 "
            "(H100)"),
    # The greedy sampler at 64 rows: 3 blocks a row (sample_heuristics.h), 10.2 us alone after greedy got its own
    # instantiation (bench_sample, H200, 2026-12-02; 15.8 us of GPT-2's batch-64 step before both changes).
    Variant("sample-clusters-past-one-wave", (Edit(SAMPLE_H, SAMPLE_FIT, ""),),
            "the rule before 2026-12-02: blocks a row by the wave of blocks alone, whether or not every row's "
            "cluster is resident at once (64 rows: 4 a row, 64 clusters, 62 held on an H200)",
            SAMPLE_STEP_CMD),
    Variant("sample-greedy-own-keys",
            (Edit(SAMPLE_K, SAMPLE_GREEDY_LOOP_START, SAMPLE_GREEDY_LOOP_START.replace(
                "    constexpr int U = 2;", "    uint32_t gkey = 0, gcol = 0;  // greedy: the thread's best piece column\n"
                "    constexpr int U = 2;")),
             Edit(SAMPLE_K, SAMPLE_GREEDY_COLUMN, SAMPLE_GREEDY_COLUMN_OWN),
             Edit(SAMPLE_K, SAMPLE_GREEDY_SCALARS, SAMPLE_GREEDY_SCALARS_OWN)),
            "prepared 2026-12-02, not yet measured (docs/lab-notes/sampling.md): greedy compares the logit's own "
            "order key (16 bits at fp16 / bf16) a column in 32 bits, packing the thread's best once",
            "python3 -m pytest -q -p no:cacheprovider bench/bench_sample.py --full -k "
            "'fused-r64-v50257-t0-float16 or fused-r16-v50257-t0-float16 or fused-r64-v50257-t0-bfloat16'"),
    Variant("sample-four-pieces", (Edit(SAMPLE_K, SAMPLE_PIECES, SAMPLE_PIECES.replace("U = 2", "U = 4")),),
            "four 16-byte pieces a thread in flight (64 registers, 24 bytes spilled at the launch bounds' cap): "
            "GPT-2's fp16 graph-fused step B64 467.2 -> 472.8 us (1.012), B16 270.4 -> 271.5 (H200, prompt 128, two "
            "interleaved rounds, 2026-12-02, before greedy's own instantiation)",
            SAMPLE_STEP_CMD),
    Variant("pdl-early-none", (Edit(PDL_H, PDL_ROWS, "constexpr long kPdlEarlyRows = 0;"),
                               Edit(PDL_H, PDL_NORM_ROWS, "constexpr long kPdlEarlyNormRows = 0;")),
            "every launch triggers late: GPT-2's step +7% at batch 1, +2% at 2, +6% at 4, +7% at 8 (H100)"),
    Variant("pdl-early-all", (Edit(PDL_H, PDL_ROWS, "constexpr long kPdlEarlyRows = 64;"),
                              Edit(PDL_H, PDL_NORM_ROWS, "constexpr long kPdlEarlyNormRows = 64;")),
            "every launch triggers early: GPT-2's B16 step +3% (H100), +7 us (H200)"),
    Variant("pdl-norms-only-early", (Edit(PDL_H, PDL_ROWS, "constexpr long kPdlEarlyRows = 0;"),
                                     Edit(PDL_H, PDL_NORM_ROWS, "constexpr long kPdlEarlyNormRows = 64;")),
            "only the norms trigger early (the correctness run of the norms' own trigger point)"),
]
VARIANTS: dict[str, Variant] = {v.name: v for v in _VARIANTS}


def apply_edit(root: Path, variant: str, e: Edit) -> None:
    """Replace e's anchor in root's copy of e.path; an anchor found zero or several times is refused."""
    replace_once(root, e.path, e.old, e.new, variant)


def copy_tree(src: Path, dst: Path) -> None:
    """A tree of the project into dst: a git work tree's files as tests.mutations.copy_repo takes them, any other
    directory's regular files (caches and .git left out)."""
    if (src / ".git").exists():
        copy_repo(src, dst)
        return
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_file() and not ({"__pycache__", ".git"} & set(rel.parts)):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dst / rel)


def prepare(root: Path, workdir: Path, v: Variant) -> Path:
    """v's copy of root under workdir (refreshed: the previous copy's files removed) with v's edits applied."""
    copy = workdir / v.name / "repo"
    if copy.exists():
        shutil.rmtree(copy)
    copy_tree(root, copy)
    for e in v.edits:
        apply_edit(copy, v.name, e)
    return copy


def parse_tree(arg: str, taken: set[str]) -> tuple[str, Path]:
    """--tree's NAME=DIR: a name no other variant has, a directory holding the project (fused_attn/, csrc/)."""
    name, sep, path = arg.partition("=")
    tree = Path(path)
    if not sep or not name or name in taken or not (tree / "fused_attn").is_dir() or not (tree / "csrc").is_dir():
        raise ValueError(f"--tree must be NAME=DIR with a new name (not {', '.join(sorted(taken))}) and DIR a tree of "
                         f"the project (fused_attn/ and csrc/ in it), got {arg!r}")
    return name, tree


def variant_env(copy: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(copy), FUSED_ATTN_CACHE=str(copy.parent / "cache"),
                PYTHONDONTWRITEBYTECODE="1")


_TIME_LINE = re.compile(r"^[ \t]*(?P<case>\S.*?):[ \t]+(?P<us>[0-9]+(?:\.[0-9]+)?)[ \t]*us\b", re.MULTILINE)


def times_from_output(output: str) -> dict[str, float]:
    """The "<case>: <time> us" lines of a command's output, case -> us (a case printed twice: its last time)."""
    return {m["case"]: float(m["us"]) for m in _TIME_LINE.finditer(output)}


def times_from_benchmark_json(path: Path) -> dict[str, float]:
    """A pytest-benchmark JSON's cases, name -> us: extra_info's p50_us (bench/harness.py), else the median. An
    empty file (pytest-benchmark leaves one for a run that collected no benchmark: a test command) has none."""
    text = path.read_text()
    if not text.strip():
        return {}
    data = json.loads(text)
    out = {}
    for b in data.get("benchmarks", []):
        p50 = b.get("extra_info", {}).get("p50_us")
        out[b["name"]] = float(p50) if p50 is not None else b["stats"]["median"] * 1e6
    return out


def is_pytest(cmd: str) -> bool:
    return "pytest" in shlex.split(cmd)


def run_cmd(copy: Path, cmd: str, timeout: float, tag: str) -> tuple[int, dict[str, float], str]:
    """(exit status, case -> us, last output line) of cmd run in copy."""
    json_path = copy.parent / f"bench-{tag}.json"
    json_path.unlink(missing_ok=True)
    full = f"{cmd} --benchmark-json={shlex.quote(str(json_path))}" if is_pytest(cmd) else cmd
    try:
        p = subprocess.run(full, shell=True, cwd=copy, env=variant_env(copy), capture_output=True, text=True,
                           timeout=timeout)
        rc, output = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        rc, output = -1, f"timed out after {timeout:.0f} s"
    times = times_from_output(output)
    if json_path.is_file():
        times.update(times_from_benchmark_json(json_path))
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return rc, times, lines[-1] if lines else ""


def build(copies: dict[str, Path]) -> dict[str, str]:
    """Each copy's library built (in parallel); name -> the failed build's last lines, for those that failed."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "fused_attn.build"], cwd=copy, env=variant_env(copy),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, copy in copies.items()}
    failed = {}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        if proc.returncode:
            failed[name] = "\n".join(out.strip().splitlines()[-20:])
    return failed


def table(names: list[str], runs: dict[str, list[tuple[int, dict[str, float], str]]]) -> str:
    """One row per case: each variant's median over its rounds, and its ratio to the default's where both ran."""
    cases: list[str] = []
    for name in names:
        for _, times, _ in runs[name]:
            cases += [c for c in times if c not in cases]
    head = ["case"] + [f"{n} us" if n == DEFAULT else f"{n} us (x default)" for n in names]
    rows = [head]
    for case in cases:
        med = {n: statistics.median(ts) for n in names
               if (ts := [times[case] for _, times, _ in runs[n] if case in times])}
        row = [case]
        for n in names:
            if n not in med:
                row.append("-")
            elif n != DEFAULT and DEFAULT in med:
                row.append(f"{med[n]:.1f} ({med[n] / med[DEFAULT]:.3f})")
            else:
                row.append(f"{med[n]:.1f}")
        rows.append(row)
    rows.append(["exit status / last line"] + [
        "; ".join(f"{rc}: {last[:60]}" for rc, _, last in runs[n]) for n in names])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("variants", nargs="*", help="names from bench/ab.py's VARIANTS")
    ap.add_argument("--list", action="store_true", help="list the variants, their edits and measurements")
    ap.add_argument("--cmd", help=f"the command run in each copy (default: the first variant's, else {DEFAULT_CMD})")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the variant sequence, interleaved")
    ap.add_argument("--no-default", action="store_true", help="run the variants only (not the unedited tree)")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="where the copies and their caches live")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another tree of the project, timed as a variant named NAME (repeatable)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per command run")
    args = ap.parse_args(argv)
    if args.list:
        for v in VARIANTS.values():
            print(f"{v.name}: {v.measured}\n    measured with: {v.cmd}")
            for e in v.edits:
                print(f"    {e.path}: {e.old!r} -> {e.new!r}")
        return 0
    unknown = [n for n in args.variants if n not in VARIANTS]
    if unknown:
        ap.error(f"variants must be names from bench/ab.py's VARIANTS ({', '.join(VARIANTS)}), got {unknown}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    chosen = [VARIANTS[n] for n in args.variants]
    trees: dict[str, Path] = {}
    for arg in args.tree:
        try:
            name, tree = parse_tree(arg, {DEFAULT, *VARIANTS, *trees})
        except ValueError as exc:
            ap.error(str(exc))
        trees[name] = tree
    if not chosen and not trees and args.no_default:
        ap.error("variants must name at least one variant with --no-default, got none")
    cmd = args.cmd or (chosen[0].cmd if chosen else DEFAULT_CMD)
    order = ([] if args.no_default else [Variant(DEFAULT, ())]) + chosen + [Variant(n, ()) for n in trees]
    copies = {v.name: prepare(trees.get(v.name, ROOT), args.workdir, v) for v in order}
    failed = build(copies)
    for name, tail in failed.items():
        print(f"== {name}: the build failed\n{tail}", file=sys.stderr)
    names = [v.name for v in order if v.name not in failed]
    runs: dict[str, list[tuple[int, dict[str, float], str]]] = {n: [] for n in names}
    for r in range(args.repeat):
        for n in names:
            runs[n].append(run_cmd(copies[n], cmd, args.timeout, f"r{r}"))
    print(f"# {cmd} ({args.repeat} round(s), medians)")
    print(table(names, runs))
    bad = bool(failed) or any(rc != 0 for n in names for rc, _, _ in runs[n])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
