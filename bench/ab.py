"""A/B timing of code variants against the tree as it is, in one GPU session.

    python -m bench.ab --list                                  # the named variants and what they measured
    python -m bench.ab decode-wide-from-8                      # against the default, bench.time_decode_graph
    python -m bench.ab flash-tma-off --cmd "python3 -m pytest bench/bench_attention.py -k causal" --repeat 2
    python -m bench.ab pdl-early-all --no-default --cmd "python3 -m pytest -q -m gpu tests/test_gpt2.py"

A variant is a list of edits (file, anchor, replacement); each anchor must occur exactly once in its file, as
tests/mutations.py's anchors must. Each variant, and the default (no edit), gets its own copy of the
repository under --workdir (the files git tracks plus the untracked ones it does not ignore:
tests.mutations.copy_repo), its own library cache (FUSED_ATTN_CACHE beside the copy) and its own build; then
the command runs in each copy in turn, --repeat rounds interleaved, and one table prints each case's time
per variant beside the default's. The checkout is only read. A copy keeps its path and its files' times
between calls, so a second call rebuilds only what its edits touch.

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
DECODE_L = "csrc/decode_attention/decode_attention_launch.h"
DECODE_CPP = "csrc/decode_attention/decode_attention.cpp"
DECODE_PY = "fused_attn/decode_attention.py"
DECODE_PAGED_TEST = "tests/test_decode_attention_paged.py"
PDL_H = "csrc/common/pdl.cuh"
PDL_ROWS = "constexpr long kPdlEarlyRows = 8;"
PDL_NORM_ROWS = "constexpr long kPdlEarlyNormRows = 16;"
WIDE = "constexpr int64_t kDecodeWideMinBatch = 16;"
NEVER = "int64_t(1) << 40"

GPT2_PY = "fused_attn/gpt2.py"
# decode-paged-page-base's edits (one a hunk): the paged rows addressed from byte strides below 2**32
# (DecodeParams; checked by the launcher and check_args, the message pinned) with wide multiply-adds, each
# row's block_table entry pointer carried from tile to tile, the pools' bases held in registers; the
# tensor-core kernel's run of rows from two addresses a tile.
PAGE_BASE_EDITS = (
    Edit(DECODE_CPP,
         "#define FA_CHECK_ROWS_ALIGNED(t)                                                                        \\\n",
         "// A page pool's page and row strides in bytes fit 32 bits (a pool of one page: its page stride is never used).\n"
         "constexpr const char* kPageStridesFit =\n"
         "    \"have page (dim 0, when num_pages > 1) and row (dim 2) strides below 2**32 bytes with block_table\";\n"
         "bool page_strides_fit(const at::Tensor& pool) {\n"
         "  const int64_t limit = int64_t(1) << 32;\n"
         "  return (pool.size(0) <= 1 || pool.stride(0) * pool.element_size() < limit) &&\n"
         "         pool.stride(2) * pool.element_size() < limit;\n"
         "}\n"
         "uint32_t page_stride_bytes(const at::Tensor& pool) {\n"
         "  return pool.size(0) <= 1 ? 0 : uint32_t(pool.stride(0) * pool.element_size());\n"
         "}\n"
         "\n"
         "#define FA_CHECK_ROWS_ALIGNED(t)                                                                        \\\n"),
    Edit(DECODE_CPP,
         "    max_len = block_table.size(1) * page_size;\n",
         "    // decode::TileRows addresses a row with 32 x 32 -> 64-bit multiply-adds of the page and row strides in bytes.\n"
         "    FA_CHECK_ARG(page_strides_fit(k_cache), k_cache, kPageStridesFit, \"strides \" + strides_str(k_cache));\n"
         "    FA_CHECK_ARG(page_strides_fit(v_cache), v_cache, kPageStridesFit, \"strides \" + strides_str(v_cache));\n"
         "    max_len = block_table.size(1) * page_size;\n"),
    Edit(DECODE_CPP,
         "    p.max_len = int(block_table->size(1) * k_cache.size(2));\n",
         "    p.k_page_bytes = page_stride_bytes(k_cache);\n"
         "    p.k_row_bytes = uint32_t(k_cache.stride(2) * k_cache.element_size());\n"
         "    p.v_page_bytes = page_stride_bytes(v_cache);\n"
         "    p.v_row_bytes = uint32_t(v_cache.stride(2) * v_cache.element_size());\n"
         "    p.page_mask = uint32_t(k_cache.size(2) - 1);\n"
         "    p.max_len = int(block_table->size(1) * k_cache.size(2));\n"),
    Edit(DECODE_K,
         "// The K and V offsets (elements, from the pools' (hkv) base) of row `row` of page `page` of a paged cache: the\n"
         "// one address computation of SlotRows, TileRows and TileRun.\n",
         "// The K and V offsets (elements, from the pools' (hkv) base) of row `row` of page `page` of a paged cache, for\n"
         "// SlotRows (the append); the loops over tiles address rows from the strides in bytes (TileRows, TileRun).\n"),
    Edit(DECODE_K,
         "// The K and V offsets (as SlotRows') of decode_kernel's N rows a thread copies in each tile of TILE slots of\n"
         "// its split, the tiles issued in order: slots j0 + n x step of the first tile, TILE slots further in each\n"
         "// next one. Paged: each row's page is looked up one tile ahead. at() takes the page loaded while the\n"
         "// previous tile was issued and, when the row's slot in the next tile lies in another page, loads that\n"
         "// page's entry (once a page a row), so no row load waits on a table load and each entry has a tile of\n"
         "// work to arrive in. Entries are read only for the slots read from the pages, below read_end = min(cached,\n"
         "// ke) (pages_ok checked them). at() is called for row n of every tile in turn while its slot j < read_end (a\n"
         "// row past it is never at() again: the tiles after a partial one are partial).\n"
         "template <bool kPaged, int N, int TILE>\n"
         "struct TileRows {\n"
         "  int pages[kPaged ? N : 1];\n"
         "  __device__ __forceinline__ void start(const DecodeParams& p, int b, int j0, int step, int read_end) {\n"
         "    if constexpr (kPaged) {\n"
         "      const int* table = p.block_table + b * p.table_stride_b;\n"
         "#pragma unroll\n"
         "      for (int n = 0; n < N; ++n) {\n"
         "        const int j = j0 + n * step;\n"
         "        pages[n] = j < read_end ? page_at(table, j >> p.page_shift) : 0;\n"
         "      }\n"
         "    }\n"
         "  }\n"
         "  __device__ __forceinline__ void at(const DecodeParams& p, int b, int read_end, int n, int j, int64_t& k_off,\n"
         "                                     int64_t& v_off) {\n"
         "    if constexpr (kPaged) {\n"
         "      const int shift = p.page_shift;\n"
         "      const int64_t page = pages[n];\n"
         "      const int j1 = j + TILE;  // this row's slot in the next tile\n"
         "      if (j < read_end - TILE && (j1 >> shift) != (j >> shift)) {\n"
         "        pages[n] = page_at(p.block_table + b * p.table_stride_b, j1 >> shift);\n"
         "      }\n"
         "      page_offsets(p, page, j & ((1 << shift) - 1), k_off, v_off);\n"
         "    } else {\n"
         "      k_off = int64_t(j) * p.k_stride_l;\n"
         "      v_off = int64_t(j) * p.v_stride_l;\n"
         "    }\n"
         "  }\n"
         "};\n"
         "\n"
         "// The K and V offsets (as SlotRows') of decode_mma_kernel's rows of each tile. Contiguous: a thread copies\n"
         "// rows r0 + n x RS (j x stride_l). Paged: it copies N consecutive rows, slots j0 .. j0 + N - 1 of each tile\n"
         "// (j0 = the tile's first slot + r0 x N; N <= 8, less than the smallest page, so they lie in at most two\n"
         "// pages), and holds the pages of the first of them and of the last it reads (< read_end), looked up one tile\n"
         "// ahead as TileRows' are (next() after each tile; an entry read only when the run moves into another\n"
         "// page): two registers a thread instead of one a row (N).\n"
         "template <bool kPaged, int N, int TILE>\n"
         "struct TileRun {\n"
         "  int first_page, last_page;\n"
         "  // The pages of the first tile's run, slots j0 .. j0 + N - 1 (those below read_end).\n"
         "  __device__ __forceinline__ void start(const DecodeParams& p, int b, int j0, int read_end) {\n"
         "    if constexpr (kPaged) {\n"
         "      const int* table = p.block_table + b * p.table_stride_b;\n",
         "// x computed once: a volatile asm is neither rematerialized inside a loop nor seen through, so a loop keeps x\n"
         "// in registers instead of re-deriving it from the parameters each iteration.\n"
         "__device__ __forceinline__ uint64_t opaque(uint64_t x) {\n"
         "  asm volatile(\"mov.b64 %0, %0;\" : \"+l\"(x));\n"
         "  return x;\n"
         "}\n"
         "\n"
         "// a x b + c, the product 64-bit: a wide multiply-add, no sign extension.\n"
         "__device__ __forceinline__ uint64_t mad_wide(uint32_t a, uint32_t b, uint64_t c) {\n"
         "  uint64_t d;\n"
         "  asm(\"mad.wide.u32 %0, %1, %2, %3;\" : \"=l\"(d) : \"r\"(a), \"r\"(b), \"l\"(c));\n"
         "  return d;\n"
         "}\n"
         "\n"
         "// The K and V rows of decode_kernel's N rows a thread copies in each tile of TILE slots of its split, the\n"
         "// tiles issued in order: slots j0 + n x step of the first tile, TILE slots further in each next one.\n"
         "// Contiguous: the sequence's base + j x stride_l. Paged: each row's page is looked up one tile ahead. at()\n"
         "// takes the page loaded while the previous tile was issued and, when the row's slot in the next tile lies in\n"
         "// another page (its row in the page + TILE reaches past the page), loads that page's entry through the row's\n"
         "// entry pointer (once a page a row), so no row load waits on a table load and each entry has a tile of work\n"
         "// to arrive in. A row's address is the pool's base (held from start()) + page x page stride + row x row\n"
         "// stride, the strides in bytes below 2**32 (DecodeParams) and the page and row unsigned (pages_ok bounds the\n"
         "// page, the row is a slot & mask): two wide multiply-adds a row, no sign extension, no table address.\n"
         "// Entries are read only for the slots read from the pages, below read_end = min(cached, ke) (pages_ok checked\n"
         "// them). at() is called for row n of every tile in turn while its slot j < read_end (a row past it is never\n"
         "// at() again: the tiles after a partial one are partial).\n"
         "template <bool kPaged, int N, int TILE>\n"
         "struct TileRows {\n"
         "  int pages[kPaged ? N : 1];\n"
         "  const int* entries[kPaged ? N : 1];  // each row's block_table entry (its page's)\n"
         "  uint64_t k_base, v_base;             // the pools' (hkv) addresses, + the thread's column\n"
         "  template <typename T>\n"
         "  __device__ __forceinline__ void start(const DecodeParams& p, int b, int j0, int step, int read_end, const T* kc,\n"
         "                                        const T* vc) {\n"
         "    if constexpr (kPaged) {\n"
         "      const int* table = p.block_table + b * p.table_stride_b;\n"
         "      k_base = opaque(reinterpret_cast<uint64_t>(kc));\n"
         "      v_base = opaque(reinterpret_cast<uint64_t>(vc));\n"
         "#pragma unroll\n"
         "      for (int n = 0; n < N; ++n) {\n"
         "        const int j = j0 + n * step;\n"
         "        entries[n] = table + (uint32_t(j) >> p.page_shift);\n"
         "        pages[n] = j < read_end ? *entries[n] : 0;\n"
         "      }\n"
         "    }\n"
         "  }\n"
         "  template <typename T>\n"
         "  __device__ __forceinline__ void at(const DecodeParams& p, int read_end, int n, int j, const T* kc, const T* vc,\n"
         "                                     const T*& ks, const T*& vs) {\n"
         "    if constexpr (kPaged) {\n"
         "      const uint32_t page = pages[n], row = uint32_t(j) & p.page_mask;\n"
         "      const uint32_t moved = (row + TILE) >> p.page_shift;  // the pages the row moves to the next tile\n"
         "      if (j < read_end - TILE && moved != 0) {\n"
         "        entries[n] += moved;\n"
         "        pages[n] = *entries[n];\n"
         "      }\n"
         "      ks = reinterpret_cast<const T*>(mad_wide(row, p.k_row_bytes, mad_wide(page, p.k_page_bytes, k_base)));\n"
         "      vs = reinterpret_cast<const T*>(mad_wide(row, p.v_row_bytes, mad_wide(page, p.v_page_bytes, v_base)));\n"
         "    } else {\n"
         "      ks = kc + int64_t(j) * p.k_stride_l;\n"
         "      vs = vc + int64_t(j) * p.v_stride_l;\n"
         "    }\n"
         "  }\n"
         "};\n"
         "\n"
         "// The K and V rows of decode_mma_kernel's rows of each tile. Contiguous: a thread copies rows r0 + n x RS\n"
         "// (the sequence's base + j x stride_l). Paged: it copies N consecutive rows, slots j0 .. j0 + N - 1 of each\n"
         "// tile (j0 = the tile's first slot + r0 x N; N <= 8, less than the smallest page, so they lie in at most two\n"
         "// pages), and holds the pages of the first of them and of the last it reads (< read_end), looked up one tile\n"
         "// ahead as TileRows' are (next() after each tile; an entry read only when the run moves into another page):\n"
         "// two registers a thread instead of one a row (N). Per tile, run() turns them into two addresses (the first\n"
         "// row's, and the second page's row 0 less the rows before it), and a row's is one of the two + n x row stride:\n"
         "// a select and a wide multiply-add a row, as TileRows' strides in bytes.\n"
         "template <bool kPaged, int N, int TILE>\n"
         "struct TileRun {\n"
         "  int first_page, last_page;\n"
         "  const int* table;         // the sequence's block_table row\n"
         "  uint64_t k_base, v_base;  // the pools' (hkv) addresses\n"
         "  // The pages of the first tile's run, slots j0 .. j0 + N - 1 (those below read_end).\n"
         "  template <typename T>\n"
         "  __device__ __forceinline__ void start(const DecodeParams& p, int b, int j0, int read_end, const T* kc,\n"
         "                                        const T* vc) {\n"
         "    if constexpr (kPaged) {\n"
         "      table = p.block_table + int64_t(opaque(uint64_t(b * p.table_stride_b)));\n"
         "      k_base = opaque(reinterpret_cast<uint64_t>(kc));\n"
         "      v_base = opaque(reinterpret_cast<uint64_t>(vc));\n"),
    Edit(DECODE_K,
         "  // Slot j of the run starting at j0 (j < read_end).\n"
         "  __device__ __forceinline__ void at(const DecodeParams& p, int j0, int j, int64_t& k_off, int64_t& v_off) const {\n"
         "    if constexpr (kPaged) {\n"
         "      const int shift = p.page_shift;\n"
         "      const int64_t page = (j >> shift) == (j0 >> shift) ? first_page : last_page;\n"
         "      page_offsets(p, page, j & ((1 << shift) - 1), k_off, v_off);\n"
         "    } else {\n"
         "      k_off = int64_t(j) * p.k_stride_l;\n"
         "      v_off = int64_t(j) * p.v_stride_l;\n"
         "    }\n"
         "  }\n"
         "  // After the tile whose run starts at j0: the pages of the next tile's run.\n"
         "  __device__ __forceinline__ void next(const DecodeParams& p, int b, int j0, int read_end) {\n"
         "    if constexpr (kPaged) {\n"
         "      if (j0 < read_end - TILE) {\n"
         "        const int* table = p.block_table + b * p.table_stride_b;\n",
         "  // The run's addresses in the tile whose run starts at j0: rows n < cross lie in the first page.\n"
         "  struct Run {\n"
         "    uint64_t k_first, v_first, k_next, v_next;\n"
         "    uint32_t cross;\n"
         "  };\n"
         "  __device__ __forceinline__ Run run(const DecodeParams& p, int j0) const {\n"
         "    Run r{};\n"
         "    if constexpr (kPaged) {\n"
         "      const uint32_t row0 = uint32_t(j0) & p.page_mask;\n"
         "      r.cross = p.page_mask + 1 - row0;\n"
         "      r.k_first = mad_wide(row0, p.k_row_bytes, mad_wide(first_page, p.k_page_bytes, k_base));\n"
         "      r.v_first = mad_wide(row0, p.v_row_bytes, mad_wide(first_page, p.v_page_bytes, v_base));\n"
         "      r.k_next = mad_wide(last_page, p.k_page_bytes, k_base) - uint64_t(r.cross) * p.k_row_bytes;\n"
         "      r.v_next = mad_wide(last_page, p.v_page_bytes, v_base) - uint64_t(r.cross) * p.v_row_bytes;\n"
         "    }\n"
         "    return r;\n"
         "  }\n"
         "  // Row n of the run (slot j < read_end).\n"
         "  template <typename T>\n"
         "  __device__ __forceinline__ void at(const DecodeParams& p, const Run& r, int n, int j, const T* kc, const T* vc,\n"
         "                                     const T*& ks, const T*& vs) const {\n"
         "    if constexpr (kPaged) {\n"
         "      const bool first = uint32_t(n) < r.cross;\n"
         "      ks = reinterpret_cast<const T*>(mad_wide(n, p.k_row_bytes, first ? r.k_first : r.k_next));\n"
         "      vs = reinterpret_cast<const T*>(mad_wide(n, p.v_row_bytes, first ? r.v_first : r.v_next));\n"
         "    } else {\n"
         "      ks = kc + int64_t(j) * p.k_stride_l;\n"
         "      vs = vc + int64_t(j) * p.v_stride_l;\n"
         "    }\n"
         "  }\n"
         "  // After the tile whose run starts at j0: the pages of the next tile's run.\n"
         "  __device__ __forceinline__ void next(const DecodeParams& p, int j0, int read_end) {\n"
         "    if constexpr (kPaged) {\n"
         "      if (j0 < read_end - TILE) {\n"),
    Edit(DECODE_K,
         "        int64_t k_off, v_off;\n"
         "        tile_rows.at(p, b, min(cached, ke), u, jt + u * NY + ty, k_off, v_off);\n"
         "        const T* ks = kc + k_off;\n"
         "        const T* vs = vc + v_off;\n",
         "        const T* ks;\n"
         "        const T* vs;\n"
         "        tile_rows.at(p, min(cached, ke), u, jt + u * NY + ty, kc, vc, ks, vs);\n"),
    Edit(DECODE_K,
         "      int64_t k_off = 0, v_off = 0;\n"
         "      if (on && j < cached) tile_rows.at(p, b, min(cached, ke), u, j, k_off, v_off);\n"
         "      const T* ks = !on ? static_cast<const T*>(p.k_cache)\n"
         "                        : j < cached ? kc + k_off : kn + (j - cached) * p.kn_stride_s;\n"
         "      const T* vs = !on ? static_cast<const T*>(p.v_cache)\n"
         "                        : j < cached ? vc + v_off : vn + (j - cached) * p.vn_stride_s;\n",
         "      const T* ks = static_cast<const T*>(p.k_cache);\n"
         "      const T* vs = static_cast<const T*>(p.v_cache);\n"
         "      if (on && j < cached) {\n"
         "        tile_rows.at(p, min(cached, ke), u, j, kc, vc, ks, vs);\n"
         "      } else if (on) {\n"
         "        ks = kn + (j - cached) * p.kn_stride_s;\n"
         "        vs = vn + (j - cached) * p.vn_stride_s;\n"
         "      }\n"),
    Edit(DECODE_K,
         "  tile_rows.start(p, b, kb + ty, NY, min(cached, ke));\n",
         "  tile_rows.start(p, b, kb + ty, NY, min(cached, ke), kc, vc);\n"),
    Edit(DECODE_K,
         "  tile_run.start(p, b, kb + r0 * N, min(cached, ke));\n"
         "  const bool col_on = c * kVec < p.headdim;\n"
         "  auto issue = [&](int t) {\n"
         "    T* ks = pipe + (t % STAGES) * 2 * TILE * HD;\n"
         "    T* vs = ks + TILE * HD;\n"
         "    const int jt = kb + t * TILE;\n"
         "    const bool fast = jt + TILE <= min(cached, ke);\n"
         "#pragma unroll\n"
         "    for (int n = 0; n < N; ++n) {\n"
         "      const int row = kPaged ? r0 * N + n : r0 + n * RS, j = jt + row;\n"
         "      const bool on = col_on && (fast || j < ke);\n"
         "      const T* ksrc = static_cast<const T*>(p.k_cache);\n"
         "      const T* vsrc = static_cast<const T*>(p.v_cache);\n"
         "      if (fast) {\n"
         "        int64_t k_off, v_off;\n"
         "        tile_run.at(p, jt + r0 * N, j, k_off, v_off);\n"
         "        ksrc = kc + k_off + c * kVec;\n"
         "        vsrc = vc + v_off + c * kVec;\n"
         "      } else if (on) {\n"
         "        int64_t k_off = 0, v_off = 0;\n"
         "        if (j < cached) tile_run.at(p, jt + r0 * N, j, k_off, v_off);\n"
         "        ksrc = (j < cached ? kc + k_off : kn + (j - cached) * p.kn_stride_s) + c * kVec;\n"
         "        vsrc = (j < cached ? vc + v_off : vn + (j - cached) * p.vn_stride_s) + c * kVec;\n"
         "      }\n"
         "      cp_async16(reinterpret_cast<uint4*>(ks + swizzled<HD>(row, c)), ksrc, on);\n"
         "      cp_async16(reinterpret_cast<uint4*>(vs + swizzled<HD>(row, c)), vsrc, on);\n"
         "    }\n"
         "    tile_run.next(p, b, jt + r0 * N, min(cached, ke));\n",
         "  tile_run.start(p, b, kb + r0 * N, min(cached, ke), kc, vc);\n"
         "  const bool col_on = c * kVec < p.headdim;\n"
         "  auto issue = [&](int t) {\n"
         "    T* ks = pipe + (t % STAGES) * 2 * TILE * HD;\n"
         "    T* vs = ks + TILE * HD;\n"
         "    const int jt = kb + t * TILE;\n"
         "    const bool fast = jt + TILE <= min(cached, ke);\n"
         "    const auto run = tile_run.run(p, jt + r0 * N);\n"
         "#pragma unroll\n"
         "    for (int n = 0; n < N; ++n) {\n"
         "      const int row = kPaged ? r0 * N + n : r0 + n * RS, j = jt + row;\n"
         "      const bool on = col_on && (fast || j < ke);\n"
         "      const T* ksrc = static_cast<const T*>(p.k_cache);\n"
         "      const T* vsrc = static_cast<const T*>(p.v_cache);\n"
         "      if (fast || (on && j < cached)) {\n"
         "        tile_run.at(p, run, n, j, kc, vc, ksrc, vsrc);\n"
         "        ksrc += c * kVec;\n"
         "        vsrc += c * kVec;\n"
         "      } else if (on) {\n"
         "        ksrc = kn + (j - cached) * p.kn_stride_s + c * kVec;\n"
         "        vsrc = vn + (j - cached) * p.vn_stride_s + c * kVec;\n"
         "      }\n"
         "      cp_async16(reinterpret_cast<uint4*>(ks + swizzled<HD>(row, c)), ksrc, on);\n"
         "      cp_async16(reinterpret_cast<uint4*>(vs + swizzled<HD>(row, c)), vsrc, on);\n"
         "    }\n"
         "    tile_run.next(p, jt + r0 * N, min(cached, ke));\n"),
    Edit(DECODE_L,
         "  // Ragged batch, or nullptr: [batch + 1] offsets, sequence b's n_b = cu[b + 1] - cu[b] new tokens at rows\n",
         "  // The page pools' page and row strides in bytes (each below 2**32: decode_attention.cpp checks), and\n"
         "  // page_size - 1: a row's address is two 32 x 32 -> 64-bit multiply-adds (decode::TileRows).\n"
         "  uint32_t k_page_bytes, k_row_bytes, v_page_bytes, v_row_bytes, page_mask;\n"
         "  // Ragged batch, or nullptr: [batch + 1] offsets, sequence b's n_b = cu[b + 1] - cu[b] new tokens at rows\n"),
    Edit(DECODE_PY,
         "def batch_of(q: torch.Tensor, k_cache, block_table, ragged: bool) -> int:\n",
         "def _check_page_strides(pool: torch.Tensor, name: str) -> None:\n"
         "    \"\"\"The CUDA kernels address a page pool's rows from its page and row strides in bytes as 32-bit values (a\n"
         "    pool of one page never uses its page stride).\"\"\"\n"
         "    size = pool.element_size()\n"
         "    if (pool.shape[0] > 1 and pool.stride(0) * size >= 2**32) or pool.stride(2) * size >= 2**32:\n"
         "        raise ValueError(f\"{name} must have page (dim 0, when num_pages > 1) and row (dim 2) strides below 2**32 \"\n"
         "                         f\"bytes with block_table, got strides {pool.stride()}\")\n"
         "\n"
         "\n"
         "def batch_of(q: torch.Tensor, k_cache, block_table, ragged: bool) -> int:\n"),
    Edit(DECODE_PY,
         "    elif k_cache.shape[0] != batch:\n",
         "        _check_page_strides(k_cache, \"k_cache\")\n"
         "        _check_page_strides(v_cache, \"v_cache\")\n"
         "    elif k_cache.shape[0] != batch:\n"),
    Edit(DECODE_PAGED_TEST,
         "@pytest.mark.parametrize(\"device\", [\"cpu\", pytest.param(\"cuda\", marks=pytest.mark.gpu)])\n"
         "def test_bad_paged_inputs_through_the_op(device):\n",
         "def test_page_strides_of_4gb_raise():\n"
         "    \"\"\"The kernels take a pool's page and row strides in bytes as 32-bit values: a page stride of 2**32 bytes\n"
         "    (2**31 float16 elements, meta tensors: no storage) is refused, for k_cache and v_cache alike; a pool of one\n"
         "    page, whose page stride is never used, is not. The C++ launcher's message is the same text.\"\"\"\n"
         "    ops = torch.ops.fused_attn\n"
         "    m = dict(device=\"meta\", dtype=torch.float16)\n"
         "    q = torch.empty(2, 4, 1, 64, **m)\n"
         "    lens = torch.empty(2, device=\"meta\", dtype=torch.int32)\n"
         "    table = torch.empty(2, 2, device=\"meta\", dtype=torch.int32)\n"
         "    pool = torch.empty(2, 2, 16, 64, **m)\n"
         "    far = torch.empty_strided((2, 2, 16, 64), (2**31, 1024, 64, 1), **m)\n"
         "    requirement = (r\"must have page \\(dim 0, when num_pages > 1\\) and row \\(dim 2\\) strides below 2\\*\\*32 bytes \"\n"
         "                   r\"with block_table, got strides \\(2147483648, 1024, 64, 1\\)\")\n"
         "    for name, k, v in ((\"k_cache\", far, pool), (\"v_cache\", pool, far)):\n"
         "        with pytest.raises(ValueError, match=f\"{name} {requirement}\"):\n"
         "            ops.decode_attention(q, k, v, lens, block_table=table)\n"
         "    one = torch.empty_strided((1, 2, 16, 64), (2**31, 1024, 64, 1), **m)\n"
         "    assert ops.decode_attention(q, one, one, lens, block_table=table).shape == q.shape\n"
         "\n"
         "\n"
         "@pytest.mark.parametrize(\"device\", [\"cpu\", pytest.param(\"cuda\", marks=pytest.mark.gpu)])\n"
         "def test_bad_paged_inputs_through_the_op(device):\n"),
)

_VARIANTS = [
    Variant("gpt2-step-launch-chain",
            (Edit(GPT2_PY, "MEGAKERNEL_MAX_ROWS = 4", "MEGAKERNEL_MAX_ROWS = 0"),),
            "GPT-2's decode step as the launch chain (~50 launches a token, PDL) at every batch, in place of "
            "gpt2_decode_step's one persistent launch at 1-4 sequences",
            "python3 -m bench.time_decode_graph --backends graph-fused --batches 1,2,4"),
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
    Variant("decode-paged-no-prefetch",
            (Edit(DECODE_K, "  if (!p.pdl_early) return;", "  if (kPaged || !p.pdl_early) return;"),),
            "no L2 prefetch before the PDL wait for a paged cache (block_table=): predicted slower at batch 1 "
            "(the contiguous cache's prefetch took MHA B1 D128 32k keys from 66.5% to 93.1% of copy bandwidth, "
            "fp16, H200)",
            "python3 -m pytest bench/bench_decode_attention.py -k 'float16 and (paged- or fused-)'"),
    Variant("decode-paged-table-per-row",
            (Edit(DECODE_K, "tile_rows.at(p, b, min(cached, ke), u, jt + u * NY + ty, k_off, v_off);",
                  "decode::SlotRows<kPaged>(p, b).at(p, jt + u * NY + ty, k_off, v_off);"),
             Edit(DECODE_K, "if (on && j < cached) tile_rows.at(p, b, min(cached, ke), u, j, k_off, v_off);",
                  "if (on && j < cached) decode::SlotRows<kPaged>(p, b).at(p, j, k_off, v_off);"),
             Edit(DECODE_K, "        tile_run.at(p, jt + r0 * N, j, k_off, v_off);\n        ksrc",
                  "        decode::SlotRows<kPaged>(p, b).at(p, j, k_off, v_off);\n        ksrc"),
             Edit(DECODE_K, "if (j < cached) tile_run.at(p, jt + r0 * N, j, k_off, v_off);",
                  "if (j < cached) decode::SlotRows<kPaged>(p, b).at(p, j, k_off, v_off);"),
             Edit(DECODE_K, "    tile_run.next(p, b, jt + r0 * N, min(cached, ke));\n", "")),
            "a block_table load in every row's address (decode::SlotRows in the loops: the pages not looked up a "
            "tile ahead): predicted slower at batch 1",
            "python3 -m pytest bench/bench_decode_attention.py -k 'float16 and (paged- or fused-)'"),
    Variant("decode-paged-check-one-entry-at-a-time",
            (Edit(DECODE_H, "constexpr int kDecodePagesInFlight = 8;", "constexpr int kDecodePagesInFlight = 1;"),),
            "a paged cache's entries checked one load at a time before a block's first tile (16 dependent L2 round "
            "trips a thread at 32k keys in pages of 16): predicted slower by 3-5% at batch 1, at any length",
            "python3 -m pytest bench/bench_decode_attention.py -k 'float16 and (paged- or fused-)'"),
    Variant("decode-paged-unsigned-offsets",
            (Edit(DECODE_K, "__device__ __forceinline__ void page_offsets(const DecodeParams& p, int64_t page, int64_t row, "
                            "int64_t& k_off,\n                                             int64_t& v_off) {\n"
                            "  k_off = page * p.k_stride_b + row * p.k_stride_l;\n"
                            "  v_off = page * p.v_stride_b + row * p.v_stride_l;\n",
                  "__device__ __forceinline__ void page_offsets(const DecodeParams& p, uint32_t page, uint32_t row, "
                  "int64_t& k_off,\n                                             int64_t& v_off) {\n"
                  "  k_off = int64_t(page * uint64_t(p.k_stride_b) + row * uint64_t(p.k_stride_l));\n"
                  "  v_off = int64_t(page * uint64_t(p.v_stride_b) + row * uint64_t(p.v_stride_l));\n"),),
            "a paged row's offsets from the page and row as unsigned 32-bit (both are: pages_ok bounds the page, the "
            "row is a slot & mask): no sign extension, 32 x 64-bit products. The CUDA-core kernel's paged tile loop "
            "447 SASS instructions against 489 (the contiguous one 337; fp16 D128, nvcc 13.0, sm_90a); the paged "
            "build ran 35% more instructions than the contiguous one at B1 MHA D128 32k and took 27% more cycles "
            "(ncu, H200). Predicted: paged B1 MHA 32k from ~0.79 of the contiguous cache's bandwidth to ~0.84. "
            "Not yet measured; its GPU tests: FLAG_VARIANTS=decode-paged-unsigned-offsets FLAG_TEST_FILES="
            "'tests/test_decode_attention_paged.py tests/test_decode_attention_ragged.py'",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'float16 and (paged- or fused-) and b1-'"),
    Variant("decode-paged-page-base", PAGE_BASE_EDITS,
            "a paged row's address as the pool's base + page x page stride + row x row stride, the strides in bytes "
            "(32-bit; k_cache / v_cache must have page and row strides below 2**32 bytes: the launcher and check_args, "
            "pinned by a test) in two "
            "wide multiply-adds, the row's block_table entry read through a pointer carried from tile to tile (no "
            "table address, no sign extension), the bases held in registers; the tensor-core kernel's 8-row run from "
            "two addresses a tile (first page, second page) and a select a row. SASS (nvcc 13.0, sm_90a, fp16, "
            "offline): the CUDA-core kernel's tile loop (R=1) D128 paged 489 -> 349 instructions, contiguous 337 -> "
            "326; D64 paged 485 -> 345, contiguous 333 -> 323; its full-tile issue path (the one every tile but the "
            "last two takes) 115 -> 54 paged, 47 contiguous (unchanged). Tensor-core tile loop D128 paged 1789 -> "
            "1165, contiguous 1405 -> 1109; D64 paged 1019 -> 757, contiguous 854 -> 687; a row of its full-tile copy "
            "~33 instructions paged against ~57, ~37 contiguous (against ~38; read off the SASS). ncu (H200, B1 MHA "
            "D128 32k, "
            "pages of 16): contiguous 51.7 M instructions = 197 a warp a tile, paged 70.1 M = 267; the variant's "
            "paged ~204 (+3.6%). Predicted: paged / contiguous bandwidth at B1 MHA D128 32k from ~0.79 to ~0.96 "
            "(0.94-0.98), D64 alike; GQA 32/8 (tensor cores) at B1 / B16 32k from 0.79 / 0.88 to >= 0.9; the "
            "contiguous provider even within noise. Not yet measured; its GPU tests: "
            "FLAG_VARIANTS=decode-paged-page-base FLAG_TEST_FILES="
            "'tests/test_decode_attention_paged.py tests/test_decode_attention_ragged.py'",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'float16 and (paged- or fused-) and b1-'"),
    Variant("decode-wide-long-caches",
            (Edit(DECODE_H, "constexpr int64_t kDecodeWideMaxLen = 2048;",
                  f"constexpr int64_t kDecodeWideMaxLen = {NEVER};"),),
            "the 256-thread build at batch >= 16 whatever the cache's length: Llama MHA B16 D128 8k / 32k keys 84.9% / "
            "93.5% of copy bandwidth against the 128-thread build's 102.6% / 104.6% (fp16, H200)",
            "python3 -m pytest bench/bench_decode_attention.py --full -k 'fused- and b16-hq32 and float16'"),
    Variant("decode-wide-from-8", (Edit(DECODE_H, WIDE, "constexpr int64_t kDecodeWideMinBatch = 8;"),),
            "the 256-thread build from batch 8: GPT-2's B8 step +2..+3 us (H100)",
            "python3 -m bench.time_decode_graph --batches 8,16"),
    Variant("decode-wide-every-batch", (Edit(DECODE_H, WIDE, "constexpr int64_t kDecodeWideMinBatch = 1;"),),
            "every one-row launch not on the deep build on the 256-thread build (the correctness run of the wide "
            "build at every batch)"),
    Variant("decode-wide-off", (Edit(DECODE_H, WIDE, f"constexpr int64_t kDecodeWideMinBatch = {NEVER};"),),
            "no wide build: GPT-2's B16 step +3.3 us at a 128-token prompt, +4.0 at 512 (H200, settled process)",
            "python3 -m bench.time_decode_graph --batches 16"),
    Variant("decode-deep-off",
            (Edit(DECODE_H, "constexpr bool kDecodeDeep = true;", "constexpr bool kDecodeDeep = false;"),),
            "32 KB pipelines only: GPT-2's fp16 B4 step +20 us (+7%), B1 +1 us (H100)",
            "python3 -m bench.time_decode_graph --batches 1,4"),
    Variant("decode-mma-one-row",
            (Edit(DECODE_H, "constexpr int kDecodeMmaMinRows = 4;", "constexpr int kDecodeMmaMinRows = 1;"),),
            "the tensor-core kernel at one row: GPT-2's step +27 to +42 us, Llama B1 H32 L8192 80-88 us against 54 "
            "(H100)"),
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


def prepare(root: Path, workdir: Path, v: Variant) -> Path:
    """v's copy of root under workdir (refreshed: the previous copy's files removed) with v's edits applied."""
    copy = workdir / v.name / "repo"
    if copy.exists():
        shutil.rmtree(copy)
    copy_repo(root, copy)
    for e in v.edits:
        apply_edit(copy, v.name, e)
    return copy


def variant_env(copy: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(copy), FUSED_ATTN_CACHE=str(copy.parent / "cache"),
                PYTHONDONTWRITEBYTECODE="1")


_TIME_LINE = re.compile(r"^[ \t]*(?P<case>\S.*?):[ \t]+(?P<us>[0-9]+(?:\.[0-9]+)?)[ \t]*us\b", re.MULTILINE)


def times_from_output(output: str) -> dict[str, float]:
    """The "<case>: <time> us" lines of a command's output, case -> us (a case printed twice: its last time)."""
    return {m["case"]: float(m["us"]) for m in _TIME_LINE.finditer(output)}


def times_from_benchmark_json(path: Path) -> dict[str, float]:
    """A pytest-benchmark JSON's cases, name -> us: extra_info's p50_us (bench/harness.py), else the median."""
    data = json.loads(path.read_text())
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
    if not chosen and args.no_default:
        ap.error("variants must name at least one variant with --no-default, got none")
    cmd = args.cmd or (chosen[0].cmd if chosen else DEFAULT_CMD)
    order = ([] if args.no_default else [Variant(DEFAULT, ())]) + chosen
    copies = {v.name: prepare(ROOT, args.workdir, v) for v in order}
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
