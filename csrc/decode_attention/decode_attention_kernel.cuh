// decode_attention kernels: a few new queries per sequence attend over its KV cache, after this
// step's keys and values are appended to the cache (fused into the same launch).
//
//   out[b, h, i] = softmax_j(q[b, h, i] · k[b, h / group, j] * scale) · v[b, h / group, j]
//   over the visible slots leftpad[b] <= j < seqlens[b] + seqlen_new (appending) - seqlen_new + 1 + i
//
// decode_kernel: one block per (sequence, kv head, chunk of R query rows, key-range split).
// A decode step moves the K and V rows of the visible slots once and little else, so the kernel
// is built to stream them at the copy bandwidth: each thread loads 16-byte pieces of U key rows
// and U value rows per iteration (16 KB per 128-thread block in flight for R <= 4), the R query
// rows that share the kv head (GQA group x new tokens) are all scored against each key while it
// is in registers, and the softmax is online (running max and sum per thread, in the log2
// domain), merged at the end over each warp's key slots with shuffles, then over the warps through
// shared memory, each thread weighting the warps' partials itself (decode::finish). Keys at slots
// >= seqlens[b] are read from k_new / v_new directly, so the append (done by one block per
// kv head) and the reads never race.
//
// Split-KV (flash-decoding): with num_splits > 1 the key range [leftpad, end) is cut into
// num_splits equal runs of whole tiles, computed from the device-side lengths, so a grid fixed
// at capture replays at any length: a split past the end exits early. Each split writes its
// normalized partial output and log2-sum-exp; decode_combine_kernel merges them
// (out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)). On sm_90, up to kMaxClusterSplits splits
// form a thread-block cluster instead and merge without the combine: each block pushes its share of
// every output slice into the slice owner's shared memory (decode::finish).
//
// Lengths out of bounds (seqlens < 0, end > max_len, leftpad outside [0, seqlens]): the
// sequence's outputs are NaN and its cache is not written; nothing past max_len is touched.
//
// Ragged batch (p.cu_seqlens_q): sequence b has n_b = cu[b + 1] - cu[b] new tokens at rows cu[b] .. of the
// packed q / k_new / v_new / out, seqlen_new above being n_b; the grid has seqlen_new = max_seqlen_q rows
// per (sequence, head), rows i >= n_b idle (no load, no output, a chunk of them exits at once:
// decode::NewRows, chunk_live). Without it, the one branch on the null pointer and no load.
//
// Paged cache (kPaged, p.block_table): the caches are page pools [num_pages, nheads_kv, page_size, headdim] and slot j
// of sequence b is row j & (page_size - 1) of page block_table[b][j >> page_shift]. An entry out of [0, num_pages)
// among the pages a sequence reads or writes is treated as out-of-bounds lengths: the rows of a split that finds it
// are poisoned (so the merged rows are NaN) and the append, made after the loop by a split that has seen every entry,
// is skipped. The tensor-core kernel's first split of each row chunk checks all of them (decode::PageCheck: loads
// before its loop, verdict after it); its other splits check nothing and clamp each entry into the pool where they use
// it (decode::in_pool), so no address leaves the pools, and a row read through a bad entry only feeds outputs the first
// split makes NaN. Each block of the CUDA-core kernel checks the entries of its own split's pages once its first tiles
// (read through clamped entries) are issued, before its loop (whose code is the cheaper for it: decode_kernel); the
// first split of chunk 0 checks the rest after its loop, before the append. The loops look each row's page up one tile
// ahead, in registers (decode::TileRows: an entry read only when a row moves into another page; decode::TileRun: its
// run's two entries every tile), so a row's address is the page's base + its row in the page with no table load in the
// way; a tile may straddle pages and page_size may be smaller than a tile. Neither kernel prefetches a paged cache into
// L2 before its PDL wait (decode::prefetch_cache: the contiguous cache's).
//
// Tests: tests/test_decode_attention.py; benchmark: bench/bench_decode_attention.py.
#pragma once

#include <atomic>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <type_traits>

#include "../common/cluster.cuh"
#include "../common/func_attrs.h"
#include "../common/math.cuh"
#include "../common/mbarrier.cuh"
#include "../common/mma.cuh"
#include "../common/pdl.cuh"
#include "../common/vec_dtypes.cuh"
#include "decode_attention_heuristics.h"
#include "decode_attention_launch.h"

namespace fused_attn {

namespace decode {

// EPT elements of type T as 16-byte words (EPT * sizeof(T) is a multiple of 16).
template <typename T, int EPT>
struct Row {
  static constexpr int kWords = EPT * int(sizeof(T)) / 16;
  uint4 w[kWords];
  __device__ __forceinline__ void load(const T* ptr) {
#pragma unroll
    // Plain loads: the rows are this launch's appends or the previous kernel's outputs (q) under PDL;
    // an __ldg is an invariant load the compiler may move above wait_for_primary().
    for (int i = 0; i < kWords; ++i) w[i] = reinterpret_cast<const uint4*>(ptr)[i];
  }
  __device__ __forceinline__ void to_float(float (&f)[EPT]) const {
    const T* v = reinterpret_cast<const T*>(w);
#pragma unroll
    for (int e = 0; e < EPT; ++e) f[e] = fused_attn::to_float(v[e]);
  }
};

// The lengths are read twice: before wait_for_primary() for the L2 prefetch (a hint, see
// prefetch_cache) and after it for the work. The second read is a relaxed load at GPU scope, which
// goes to L2: a plain load could hit the L1 line the first read left (L1 is not coherent), stale if
// an earlier kernel of the PDL chain was still writing the lengths then (sample(advance=) just before).
__device__ __forceinline__ int load_length(const int* ptr, bool before_wait) {
  return before_wait ? *ptr : load_after_wait(ptr);
}

// Sequence b's new tokens: n of them at rows row0 .. row0 + n - 1 of the packed q / k_new / v_new / out
// (ragged: p.cu_seqlens_q, read here), or p.seqlen_new at row 0 (no load: the 4-dim layout's stride_b
// locates the sequence). Offsets out of range (cu[b] > cu[b + 1], outside [0, total_q], n_b > max_seqlen_q):
// ok false, treated as out-of-bounds lengths (NaN, no append), n then the rows that may take the NaN
// (min(n_b, max_seqlen_q) inside [0, total_q], else none: no row outside q's is touched).
struct NewRows {
  int n, row0;
  bool ok;
};
__device__ __forceinline__ NewRows new_rows(const DecodeParams& p, int b, bool before_wait = false) {
  if (p.cu_seqlens_q == nullptr) return {p.seqlen_new, 0, true};
  const int lo = load_length(p.cu_seqlens_q + b, before_wait), hi = load_length(p.cu_seqlens_q + b + 1, before_wait);
  const bool inside = lo >= 0 && lo <= hi && hi <= p.total_q;
  const int n = inside ? hi - lo : 0;
  return {min(n, p.seqlen_new), inside ? lo : 0, inside && n <= p.seqlen_new};
}

// Row rr of kv head hkv's group x seqlen_new query rows as its query head h and new token i.
struct RowHead {
  int h, i;
};
__device__ __forceinline__ RowHead row_head(const DecodeParams& p, int hkv, int rr) {
  int hq, i;
  p.div_seqlen_new.divmod(rr, hq, i);
  return {hkv * p.group + hq, i};
}
// Element idx of a block's rows x headdim outputs (row-major; the rows: rows_per_block of the kv head's, from
// chunk x rows_per_block): its row r in the block, column e, and the row's query head h and new token i.
struct OutElem {
  int r, e, h, i;
};
__device__ __forceinline__ OutElem out_elem(const DecodeParams& p, int chunk, int rows_per_block, int hkv, int idx) {
  int r, e;
  p.div_headdim.divmod(idx, r, e);
  const RowHead rh = row_head(p, hkv, chunk * rows_per_block + r);
  return {r, e, rh.h, rh.i};
}
// The output of sequence b's query head h at q row `row` (the sequence's new token + its cu_seqlens_q offset),
// column e.
template <typename T>
__device__ __forceinline__ T& out_at(const DecodeParams& p, int b, int h, int row, int e) {
  return static_cast<T*>(p.out)[b * p.o_stride_b + h * p.o_stride_h + row * p.o_stride_s + e];
}

__device__ __forceinline__ bool lengths_ok(const DecodeParams& p, int b, const NewRows& nr, int& cached, int& end,
                                           int& start, bool before_wait = false) {
  cached = p.seqlens != nullptr ? load_length(p.seqlens + b, before_wait) : p.max_len;
  const int appended = p.k_new != nullptr ? nr.n : 0;
  start = p.leftpad != nullptr ? load_length(p.leftpad + b, before_wait) : 0;
  // Compared before adding: cached + seqlen_new may overflow int for a garbage length.
  const bool ok = nr.ok && cached >= 0 && cached <= p.max_len - appended && start >= 0 && start <= cached;
  end = ok ? cached + appended : 0;
  return ok;
}
__device__ __forceinline__ bool lengths_ok(const DecodeParams& p, int b, int& cached, int& end, int& start,
                                           bool before_wait = false) {
  return lengths_ok(p, b, new_rows(p, b, before_wait), cached, end, start, before_wait);
}

// Ragged: whether any of the chunk's R query rows is one of the sequence's n_b tokens (a chunk of idle rows,
// i >= n_b, has no output and exits before loading a key). Always true without cu_seqlens_q. The chunk's rows
// take the token positions rr % seqlen_new in turn from its first row's, a: one of them is below n_b when a is, or
// when the positions wrap to 0 inside the chunk (one division; a loop over the rows took R).
template <int R>
__device__ __forceinline__ bool chunk_live(const DecodeParams& p, int chunk, const NewRows& nr) {
  if (p.cu_seqlens_q == nullptr) return true;
  const int first = chunk * R, count = min(R, p.rows - first), a = p.div_seqlen_new.mod(first);
  return count > 0 && nr.n > 0 && (a < nr.n || p.seqlen_new - a < count);
}

// The tensor-core kernel's lengths: lengths_ok, and with a paged cache an empty pool only where nothing is read or
// written. Out of bounds: false, and cached = start = end = 0, so the block reads no key (its rows are poisoned
// at the end, after the loop) and appends nothing.
template <bool kPaged>
__device__ __forceinline__ bool read_lengths(const DecodeParams& p, int b, const NewRows& nr, int& cached, int& end,
                                             int& start) {
  const bool ok = lengths_ok(p, b, nr, cached, end, start) && (!kPaged || p.num_pages > 0 || end == start);
  if (!ok) cached = end = start = 0;
  return ok;
}
// The key slots [kb, ke) of split `split` of a sequence whose visible slots are [start, end): whole
// tiles of TILE slots, the same count per split (a split past the end gets an empty range).
__device__ __forceinline__ void split_range(const DecodeParams& p, int start, int end, int split, int tile, int& kb,
                                            int& ke) {
  const int tiles = (end - start + tile - 1) / tile;
  const int tiles_per_split = p.div_splits.div(tiles + p.num_splits - 1);
  kb = start + split * tiles_per_split * tile;
  ke = min(end, kb + tiles_per_split * tile);
}

// The K and V offsets (elements, from the pools' (hkv) base) of row `row` of page `page` of a paged cache, for
// SlotRows (the append); the loops over tiles address rows from the strides in bytes (TileRows, TileRun).
__device__ __forceinline__ void page_offsets(const DecodeParams& p, int64_t page, int64_t row, int64_t& k_off,
                                             int64_t& v_off) {
  k_off = page * p.k_stride_b + row * p.k_stride_l;
  v_off = page * p.v_stride_b + row * p.v_stride_l;
}

// Page of logical block blk of a sequence (blk: a slot >> page_shift; table: the sequence's block_table row),
// read after wait_for_primary() (a plain load).
__device__ __forceinline__ int page_at(const int* table, int blk) {
  return table[blk];
}
// A loaded entry as a page the tensor-core kernel (TileRun) may address: itself when in [0, num_pages), else the
// pool's last page (a negative entry is >= 2**31 unsigned). Applied where the page is used, a tile after its load,
// so no thread waits for the load there; the first split's PageCheck makes the outputs of a sequence with such an
// entry NaN. num_pages >= 1 wherever a row is read (the kernels treat an empty pool as bad lengths).
__device__ __forceinline__ uint32_t in_pool(const DecodeParams& p, int page) {
  return min(uint32_t(page), uint32_t(p.num_pages - 1));
}

// The offsets (elements) of slot j's K and V rows of one sequence from that sequence's base (caches +
// hkv x stride_h, + b x stride_b when contiguous: cache_base). Contiguous: j x stride_l. Paged: the page
// from this sequence's row of block_table, then the row in the page. For one row (the append); the loops
// over tiles take TileRows.
template <bool kPaged>
struct SlotRows {
  const int* table;  // block_table + b x table_stride_b (paged)
  int shift, mask;   // log2(page_size), page_size - 1
  __device__ __forceinline__ SlotRows(const DecodeParams& p, int b)
      : table(kPaged ? p.block_table + b * p.table_stride_b : nullptr),
        shift(p.page_shift),
        mask((1 << p.page_shift) - 1) {}
  __device__ __forceinline__ void at(const DecodeParams& p, int j, int64_t& k_off, int64_t& v_off) const {
    if constexpr (kPaged) {
      page_offsets(p, page_at(table, j >> shift), j & mask, k_off, v_off);
    } else {
      k_off = int64_t(j) * p.k_stride_l;
      v_off = int64_t(j) * p.v_stride_l;
    }
  }
};

// x computed once: a volatile asm is neither rematerialized inside a loop nor seen through, so a loop keeps x
// in registers instead of re-deriving it from the parameters each iteration.
__device__ __forceinline__ uint64_t opaque(uint64_t x) {
  asm volatile("mov.b64 %0, %0;" : "+l"(x));
  return x;
}

// a x b + c, the product 64-bit: a wide multiply-add, no sign extension.
__device__ __forceinline__ uint64_t mad_wide(uint32_t a, uint32_t b, uint64_t c) {
  uint64_t d;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}

// The K and V rows of decode_kernel's N rows a thread copies in each tile of TILE slots of its split, the tiles
// issued in order: slots j0 + n x step of the first tile, TILE slots further in each next one. Contiguous: the
// sequence's base + j x stride_l. Paged: each row's page is looked up one tile ahead. at() takes the page loaded
// while the previous tile was issued and, when the row's slot in the next tile lies in another page (its row in the
// page + TILE reaches past the page), loads that page's entry through the row's entry pointer (once a page a row),
// so no row load waits on a table load and each entry has a tile of work to arrive in. A row's address is the pool's
// base (held from start()) + page x page stride + row x row stride, the strides in bytes below 2**32 (DecodeParams)
// and the page and row unsigned (the row is a slot & mask; the page: at<true>, the block's first tiles, issued before
// pages_ok has checked the entries, clamps it into the pool; the loop's at<false> takes it as loaded, checked): two
// wide multiply-adds a row, no sign extension, no table address. Entries are read only for the slots read from the
// pages, below read_end = min(cached, ke). at() is called for row n of every tile in turn while its slot j <
// read_end (a row past it is never at() again: the tiles after a partial one are partial).
template <bool kPaged, int N, int TILE>
struct TileRows {
  int pages[kPaged ? N : 1];
  const int* entries[kPaged ? N : 1];  // each row's block_table entry (its page's)
  uint64_t k_base, v_base;             // the pools' (hkv) addresses, + the thread's column
  template <typename T>
  __device__ __forceinline__ void start(const DecodeParams& p, int b, int j0, int step, int read_end, const T* kc,
                                        const T* vc) {
    if constexpr (kPaged) {
      const int* table = p.block_table + b * p.table_stride_b;
      k_base = opaque(reinterpret_cast<uint64_t>(kc));
      v_base = opaque(reinterpret_cast<uint64_t>(vc));
#pragma unroll
      for (int n = 0; n < N; ++n) {
        const int j = j0 + n * step;
        entries[n] = table + (uint32_t(j) >> p.page_shift);
        pages[n] = j < read_end ? *entries[n] : 0;
      }
    }
  }
  template <bool kClamp = false, typename T>
  __device__ __forceinline__ void at(const DecodeParams& p, int read_end, int n, int j, const T* kc, const T* vc,
                                     const T*& ks, const T*& vs) {
    if constexpr (kPaged) {
      const uint32_t page = kClamp ? in_pool(p, pages[n]) : uint32_t(pages[n]), row = uint32_t(j) & p.page_mask;
      const uint32_t moved = (row + TILE) >> p.page_shift;  // the pages the row moves to the next tile
      if (j < read_end - TILE && moved != 0) {
        entries[n] += moved;
        pages[n] = *entries[n];
      }
      ks = reinterpret_cast<const T*>(mad_wide(row, p.k_row_bytes, mad_wide(page, p.k_page_bytes, k_base)));
      vs = reinterpret_cast<const T*>(mad_wide(row, p.v_row_bytes, mad_wide(page, p.v_page_bytes, v_base)));
    } else {
      ks = kc + int64_t(j) * p.k_stride_l;
      vs = vc + int64_t(j) * p.v_stride_l;
    }
  }
};

// The K and V rows of decode_mma_kernel's rows of each tile. Contiguous: a thread copies rows r0 + n x RS
// (the sequence's base + j x stride_l). Paged: it copies N consecutive rows, slots j0 .. j0 + N - 1 of each
// tile (j0 = the tile's first slot + r0 x N; N <= 8, less than the smallest page, so they lie in at most two
// pages), and holds the pages of the first of them and of the last it reads (< read_end), looked up one tile
// ahead (next() after each tile reads both entries): two registers a thread instead of one a row (N). Per
// tile, run() turns them into two addresses (the first row's, and the second page's row 0 less the rows before
// it), and a row's is one of the two + n x row stride: a select and a wide multiply-add a row, as TileRows'
// strides in bytes.
template <bool kPaged, int N, int TILE>
struct TileRun {
  int first_page, last_page;
  const int* table;         // the sequence's block_table row
  uint64_t k_base, v_base;  // the pools' (hkv) addresses
  // The pages of the first tile's run, slots j0 .. j0 + N - 1 (those below read_end).
  template <typename T>
  __device__ __forceinline__ void start(const DecodeParams& p, int b, int j0, int read_end, const T* kc,
                                        const T* vc) {
    if constexpr (kPaged) {
      table = p.block_table + int64_t(opaque(uint64_t(b * p.table_stride_b)));
      k_base = opaque(reinterpret_cast<uint64_t>(kc));
      v_base = opaque(reinterpret_cast<uint64_t>(vc));
      first_page = last_page = 0;
      if (j0 < read_end) {
        first_page = page_at(table, j0 >> p.page_shift);
        last_page = page_at(table, min(j0 + N - 1, read_end - 1) >> p.page_shift);
      }
    }
  }
  // The run's addresses in the tile whose run starts at j0: rows n < cross lie in the first page.
  struct Run {
    uint64_t k_first, v_first, k_next, v_next;
    uint32_t cross;
  };
  __device__ __forceinline__ Run run(const DecodeParams& p, int j0) const {
    Run r{};
    if constexpr (kPaged) {
      const uint32_t row0 = uint32_t(j0) & p.page_mask, first = in_pool(p, first_page), last = in_pool(p, last_page);
      r.cross = p.page_mask + 1 - row0;
      r.k_first = mad_wide(row0, p.k_row_bytes, mad_wide(first, p.k_page_bytes, k_base));
      r.v_first = mad_wide(row0, p.v_row_bytes, mad_wide(first, p.v_page_bytes, v_base));
      r.k_next = mad_wide(last, p.k_page_bytes, k_base) - uint64_t(r.cross) * p.k_row_bytes;
      r.v_next = mad_wide(last, p.v_page_bytes, v_base) - uint64_t(r.cross) * p.v_row_bytes;
    }
    return r;
  }
  // Row n of the run (slot j < read_end).
  template <typename T>
  __device__ __forceinline__ void at(const DecodeParams& p, const Run& r, int n, int j, const T* kc, const T* vc,
                                     const T*& ks, const T*& vs) const {
    if constexpr (kPaged) {
      const bool first = uint32_t(n) < r.cross;
      ks = reinterpret_cast<const T*>(mad_wide(n, p.k_row_bytes, first ? r.k_first : r.k_next));
      vs = reinterpret_cast<const T*>(mad_wide(n, p.v_row_bytes, first ? r.v_first : r.v_next));
    } else {
      ks = kc + int64_t(j) * p.k_stride_l;
      vs = vc + int64_t(j) * p.v_stride_l;
    }
  }
  // After the tile whose run starts at j0: the pages of the next tile's run, both read every tile. Nothing
  // consumes them before the next tile's run(), a tile of work later. Reusing a page already held (a select
  // on the loaded entry) made every thread wait for its load right there, each tile: B4 GQA 32/8 D64 128k,
  // pages of 16, 403 -> 341 us (H200, fp16, bench.ab against the select, 2026-11-29).
  __device__ __forceinline__ void next(const DecodeParams& p, int j0, int read_end) {
    if constexpr (kPaged) {
      if (j0 < read_end - TILE) {
        const int j1 = j0 + TILE;
        first_page = page_at(table, j1 >> p.page_shift);
        last_page = page_at(table, min(j1 + N - 1, read_end - 1) >> p.page_shift);
      }
    }
  }
};

// Element offset of sequence b's rows in a contiguous cache (0 in a page pool: SlotRows adds the page).
template <bool kPaged>
__device__ __forceinline__ int64_t cache_base(int b, int64_t stride_b) {
  return kPaged ? 0 : b * stride_b;
}

// The block_table entries [first, last) of the pages holding slots [start, end) (none when the range is empty): what
// both checks below read.
__device__ __forceinline__ void page_span(const DecodeParams& p, int start, int end, int& first, int& last) {
  first = start >> p.page_shift;
  last = end > start ? ((end - 1) >> p.page_shift) + 1 : first;
}

// Paged: whether every block_table entry of the pages holding slots [start, end) is in [0, num_pages), read by
// the block's threads together (called by every thread of the block, with the same start and end). Contiguous:
// true. kDecodePagesInFlight loads a thread issued before any is compared (the heuristics' entry), one entry a load,
// each compared: the CUDA-core kernel's check (the tensor-core kernel's: PageCheck). Four entries a 16-byte load
// there gave its loop 394-400 instructions a tile instead of 345 (nvcc 13.0, fp16, D64, paged, one row).
template <bool kPaged>
__device__ __forceinline__ bool pages_ok(const DecodeParams& p, int b, int start, int end) {
  if constexpr (!kPaged) {
    return true;
  } else {
    const int* table = p.block_table + b * p.table_stride_b;
    int first, last;
    page_span(p, start, end, first, last);
    const int t = int(threadIdx.x), step = kDecodePagesInFlight * int(blockDim.x);
    bool bad = false;
    for (int i0 = first + t; i0 < last; i0 += step) {
      int e[kDecodePagesInFlight];
#pragma unroll
      for (int k = 0; k < kDecodePagesInFlight; ++k) {
        const int i = i0 + k * int(blockDim.x);
        e[k] = i < last ? table[i] : 0;
      }
#pragma unroll
      for (int k = 0; k < kDecodePagesInFlight; ++k) bad |= e[k] < 0 || e[k] >= p.num_pages;
    }
    return !__syncthreads_or(bad);
  }
}

// A load whose place among the kernel's other asm statements (the cp.async copies, the barriers) the compiler
// keeps: issued where it is written, however late its value is first used.
__device__ __forceinline__ uint32_t load_issued_here(const int* ptr) {
  uint32_t v;
  asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
}

// The tensor-core kernel's first split checks every block_table entry of the pages holding its sequence's slots
// [start, end) (the other splits read through clamped entries: in_pool), as pages_ok, in two halves. issue(), before
// the block's main loop, copies the first kDecodePagesEarly 16-byte groups of four entries a thread into shared
// memory (`stage`, cp.async: no register holds them through the loop; they complete with the loop's copies) and loads
// the up to three single entries on either side of the groups' 16-byte boundaries (the first threads the leading
// ones, the last threads the trailing ones: one register). ok(), after the loop's last cp.async wait, takes their
// largest as unsigned (a negative entry is >= 2**31), checks the other groups in rounds of kDecodePagesInFlight a
// thread, and returns the block's verdict. Every thread of the block calls both, with the same start and end; a
// thread reads back only the groups it copied. So the first round's L2 / DRAM trip is under the loop instead of on
// the first split's way to the merge, which every other split of the sequence waits for. Holding the groups in
// registers instead made nvcc recompute the loop's shared-memory addresses every tile (D64 paged: its main loop 787
// -> 889 SASS instructions, nvcc 13.0, sm_90a). Contiguous: no load, ok() true.
template <bool kPaged>
struct PageCheck {
  uint32_t edge = 0;
  struct Range {
    const int* table;
    int first, a, z, last;  // [first, a) and [z, last): single entries; [a, z): groups of four at 16-byte boundaries
  };
  __device__ __forceinline__ static Range range(const DecodeParams& p, int b, int start, int end) {
    Range r;
    r.table = p.block_table + b * p.table_stride_b;
    page_span(p, start, end, r.first, r.last);
    const int skip = int((16 - (reinterpret_cast<uintptr_t>(r.table + r.first) & 15)) & 15) / 4;
    r.a = min(r.last, r.first + skip);
    r.z = r.a + (r.last - r.a) / 4 * 4;
    return r;
  }
  // stage: kDecodePagesEarly x blockDim.x 16-byte slots of shared memory, slot k x blockDim.x + thread.
  __device__ __forceinline__ void issue(const DecodeParams& p, int b, int start, int end, uint4* stage) {
    if constexpr (kPaged) {
      const Range r = range(p, b, start, end);
      const int t = int(threadIdx.x), u = int(blockDim.x) - 1 - t, n = (r.z - r.a) / 4;
      if (t < r.a - r.first) edge = load_issued_here(r.table + r.first + t);
      if (u < r.last - r.z) edge = load_issued_here(r.table + r.z + u);  // blockDim.x > 6: not a leading thread
      const uint4* groups = reinterpret_cast<const uint4*>(r.table + r.a);
#pragma unroll
      for (int k = 0; k < kDecodePagesEarly; ++k) {
        const int g = t + k * int(blockDim.x);
        cp_async16(stage + g, g < n ? static_cast<const void*>(groups + g) : p.k_cache, g < n);  // zeros past them
      }
    }
  }
  // After cp_async_wait<0>() (the staged groups landed). The range is computed again rather than held: only the
  // loaded values live through the loop.
  __device__ __forceinline__ bool ok(const DecodeParams& p, int b, int start, int end, const uint4* stage) const {
    if constexpr (!kPaged) {
      return true;
    } else {
      const Range r = range(p, b, start, end);
      const int n = (r.z - r.a) / 4;
      const uint4* groups = reinterpret_cast<const uint4*>(r.table + r.a);
      uint32_t worst = edge;
#pragma unroll
      for (int k = 0; k < kDecodePagesEarly; ++k) {
        const uint4 e = stage[int(threadIdx.x) + k * int(blockDim.x)];
        worst = max(worst, max(max(e.x, e.y), max(e.z, e.w)));
      }
      const int step = kDecodePagesInFlight * int(blockDim.x);
      for (int g0 = int(threadIdx.x) + kDecodePagesEarly * int(blockDim.x); g0 < n; g0 += step) {
        uint4 e[kDecodePagesInFlight];
#pragma unroll
        for (int k = 0; k < kDecodePagesInFlight; ++k) {
          const int g = g0 + k * int(blockDim.x);
          e[k] = g < n ? groups[g] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < kDecodePagesInFlight; ++k) {
          worst = max(worst, max(max(e[k].x, e[k].y), max(e[k].z, e[k].w)));
        }
      }
      return !__syncthreads_or(r.last > r.first && worst >= uint32_t(p.num_pages));
    }
  }
};

// A block's rows poisoned: a NaN running max makes every weight of the merge NaN, so the rows' outputs (one
// split), their partials (the combine kernel) or their merge in the cluster come out NaN.
template <int N>
__device__ __forceinline__ void poison(float (&m)[N]) {
#pragma unroll
  for (int r = 0; r < N; ++r) m[r] = __int_as_float(0x7fc00000);
}

// Before wait_for_primary(): the cached K and V rows this block will read into L2, so their DRAM
// round trip overlaps the previous kernel (under PDL the block starts early: pdl.cuh). The slots are
// written by earlier steps, not by the kernels this one overlaps; only the lengths might be (a caller
// whose previous kernel writes seqlens): then the stale values make a wrong hint, nothing else. A
// prefetch moves no data into the block, L2 is where every write lands, and every address is inside
// the cache (lengths_ok bounds end by max_len). A contiguous cache only: a paged cache's rows would be
// found through block_table loads the block waits for before it goes on, and neither kernel gains
// from that (decode_kernel, decode_mma_kernel).
template <typename T>
__device__ __forceinline__ void prefetch_cache(const DecodeParams& p, int b, int hkv, int split, int tile) {
  if (!p.pdl_early) return;  // both parts of the run-ahead together (pdl.cuh)
  int cached, end, start, kb, ke;
  if (!lengths_ok(p, b, cached, end, start, /*before_wait=*/true)) return;
  split_range(p, start, end, split, tile, kb, ke);
  // Slots from `cached` on are this step's appends (k_new / v_new); the bound: decode_attention_heuristics.h.
  const int hi = min(min(ke, cached), kb + kDecodePrefetchMaxSlots);
  const int lines = (p.headdim * int(sizeof(T)) + 127) / 128, per_line = 128 / int(sizeof(T));
  const T* kc = static_cast<const T*>(p.k_cache) + b * p.k_stride_b + hkv * p.k_stride_h;
  const T* vc = static_cast<const T*>(p.v_cache) + b * p.v_stride_b + hkv * p.v_stride_h;
  for (int j = kb + int(threadIdx.x); j < hi; j += blockDim.x) {  // a row's lines: no division by `lines`
    for (int c = 0; c < lines * per_line; c += per_line) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(kc + int64_t(j) * p.k_stride_l + c));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(vc + int64_t(j) * p.v_stride_l + c));
    }
  }
}

// Writes this step's keys and values of (b, kv head) into the cache: nr.n x headdim each.
template <typename T, bool kPaged>
__device__ void append(const DecodeParams& p, int b, int hkv, int cached, const NewRows& nr) {
  constexpr int kVec = 16 / int(sizeof(T));
  const int n = nr.n * p.headdim / kVec;  // headdim % kVec == 0
  const SlotRows<kPaged> rows(p, b);
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    int i, c;  // row, first column
    p.div_headdim.divmod(idx * kVec, i, c);
    const int64_t row = nr.row0 + i;
    const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_stride_b + hkv * p.kn_stride_h + row * p.kn_stride_s + c;
    const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_stride_b + hkv * p.vn_stride_h + row * p.vn_stride_s + c;
    int64_t k_off, v_off;
    rows.at(p, cached + i, k_off, v_off);
    T* kc = static_cast<T*>(p.k_cache) + cache_base<kPaged>(b, p.k_stride_b) + hkv * p.k_stride_h + k_off + c;
    T* vc = static_cast<T*>(p.v_cache) + cache_base<kPaged>(b, p.v_stride_b) + hkv * p.v_stride_h + v_off + c;
    *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kn);
    *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(vn);
  }
}

// decode_kernel's block whose sequence has out-of-bounds lengths (every split of it sees them): its rows'
// outputs are NaN, written by the one split that owns them (one split; split 0 of a cluster), or, with the
// combine kernel, each split's partial log2-sum-exp is NaN, which makes the merged row NaN.
template <typename T, int R>
__device__ __forceinline__ void write_nan_rows(const DecodeParams& p, int chunk, int b, int hkv, int split,
                                               const NewRows& nr) {
  const bool partials = p.num_splits > 1 && !p.cluster;
  if (!partials && split != 0) return;
  const int sn = p.seqlen_new;
  const float nan = __int_as_float(0x7fc00000);
  for (int idx = threadIdx.x; idx < R * p.headdim; idx += blockDim.x) {
    const OutElem o = out_elem(p, chunk, R, hkv, idx);
    if (chunk * R + o.r >= p.rows || o.i >= nr.n) continue;
    if (partials) {
      if (o.e == 0) p.partial_lse[((int64_t(split) * p.batch + b) * p.nheads_q + o.h) * sn + o.i] = nan;
    } else {
      out_at<T>(p, b, o.h, nr.row0 + o.i, o.e) = from_float<T>(nan);
    }
  }
}

// The merge of a block's NW key slots for row r: the slots' running maxima sm_m [R][NW] and sums sm_l
// [R][NW] (written and synchronized by the caller) as the row's max, its sum, and each slot's weight
// 2^(m_y - max). Every thread that needs a row computes them itself from broadcast reads: no thread
// merges first, no second barrier. A NaN max makes every weight NaN (the row comes out NaN).
template <int R, int NW>
__device__ __forceinline__ float slot_weights(const float* sm_m, const float* sm_l, int r, float (&w)[NW],
                                              float& sum) {
  float mx = kNegInf;
#pragma unroll
  for (int y = 0; y < NW; ++y) mx = max_nan(mx, sm_m[r * NW + y]);
  sum = 0.f;
#pragma unroll
  for (int y = 0; y < NW; ++y) {
    w[y] = mx == kNegInf ? 0.f : fast_exp2(sm_m[r * NW + y] - mx);
    sum = fmaf(w[y], sm_l[r * NW + y], sum);
  }
  return mx;
}

// Element e of row r merged over the block's NW slots (o from sm_o [R][NW][HD]), unnormalized: the sum
// of the slots' weighted outputs; the row's max and sum as slot_weights gives them.
template <int R, int NW, int HD>
__device__ __forceinline__ float merge_slots(const float* sm_o, const float* sm_m, const float* sm_l, int r, int e,
                                             float& mx, float& sum) {
  float w[NW];
  mx = slot_weights<R, NW>(sm_m, sm_l, r, w, sum);
  float acc = 0.f;
#pragma unroll
  for (int y = 0; y < NW; ++y) acc = fmaf(w[y], sm_o[(r * NW + y) * HD + e], acc);
  return acc;
}

// Shared memory the cluster merge needs in each block beside the kernel's own (launch_decode,
// launch_decode_mma): an mbarrier (16 bytes with its padding), the pushed outputs [splits][slice]
// (slice = ceil(R x headdim / splits) elements, all of them together at most R x HD + kMaxClusterSplits
// floats) and the pushed (max, sum) of each block's rows [splits][R][2].
template <int R, int HD>
constexpr int kPushBytes = 16 + (R * HD + kMaxClusterSplits + kMaxClusterSplits * R * 2) * 4;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The cluster merge's mbarrier, first in the push region: initialized by the kernel's thread 0 before it
// arrives on the cluster barrier at its start (cluster_merge_init), so no block pushes before it exists.
__device__ __forceinline__ void cluster_merge_init(unsigned char* push) {
  if (threadIdx.x == 0) {
    mbarrier_init_for_pushes(reinterpret_cast<uint64_t*>(push));
  }
  cluster_arrive_release();  // phase 1: started, the mbarrier initialized
}
#endif

// The end of a block's work: its NW key slots' partial results per row r (max sm_m[r][y], sum
// sm_l[r][y], unnormalized output sm_o[r][y][:], written and synchronized by the caller) merged into
// the row's output (one split), the split's partial (combine kernel), or, with the cluster merge, pushed
// to the blocks of the cluster: block c owns the slice c of the R x headdim outputs and receives every
// block's share of it, and every block's (max, sum) of the rows, in its own shared memory (`push`,
// kPushBytes) by st.async stores that count their bytes on its mbarrier; each block waits only for the
// bytes it owns, then merges its slice locally. No cluster barrier after the start's: measured in the
// batch-1..8 steps of GPT-2 (H100, docs/lab-notes/decode-attention.md), the merge with a release / acquire cluster
// barrier spent 0.5 us in the release alone, ~2 us in all.
template <typename T, int R, int NW, int HD>
__device__ __forceinline__ void finish(const DecodeParams& p, const float* sm_o, const float* sm_m, const float* sm_l,
                                       unsigned char* push, int chunk, int b, int hkv, int split, const NewRows& nr) {
  const int sn = p.seqlen_new, n = R * p.headdim;
  const int live_rows = min(R, p.rows - chunk * R), live = live_rows * p.headdim;  // real (not padding) rows
  if (!p.cluster) {
    for (int idx = threadIdx.x; idx < live; idx += blockDim.x) {
      const OutElem o = out_elem(p, chunk, R, hkv, idx);
      if (o.i >= nr.n) continue;  // ragged: not a token of the sequence
      float mx, sum;
      const float acc = merge_slots<R, NW, HD>(sm_o, sm_m, sm_l, o.r, o.e, mx, sum);
      if (p.num_splits == 1) {
        const float val = sum == 0.f ? 0.f : acc / sum;  // no visible key: 0; NaN stays NaN
        out_at<T>(p, b, o.h, nr.row0 + o.i, o.e) = from_float<T>(val);
      } else {
        const int64_t row = ((int64_t(split) * p.batch + b) * p.nheads_q + o.h) * sn + o.i;
        p.partial_o[row * p.headdim + o.e] = sum == 0.f ? 0.f : acc / sum;
        if (o.e == 0) p.partial_lse[row] = sum == 0.f ? kNegInf : mx + __log2f(sum);
      }
    }
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int n_blocks = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  const int slice = p.div_slice.d;  // ceil(n / n_blocks), from the launcher (decode_cluster_slice)
  uint64_t* const bar = reinterpret_cast<uint64_t*>(push);
  float* const push_o = reinterpret_cast<float*>(push + 16);  // [n_blocks][slice]
  float* const push_ml = push_o + R * HD + kMaxClusterSplits;  // [n_blocks][R][2]
  const int lo = rank * slice, hi = min(n, lo + slice);
  cluster_wait();  // phase 1: every block of the cluster has started, its mbarrier initialized
  if (threadIdx.x == 0) {  // the bytes this block receives: its slice's live outputs and the live rows' (max, sum)
    const int mine = max(0, min(hi, live) - lo);
    mbarrier_arrive_expect_tx(bar, uint32_t(n_blocks * (mine * 4 + live_rows * 8)));
  }
  for (int idx = threadIdx.x; idx < live; idx += blockDim.x) {
    int r, e;
    p.div_headdim.divmod(idx, r, e);
    float mx, sum;
    const float acc = merge_slots<R, NW, HD>(sm_o, sm_m, sm_l, r, e, mx, sum);
    const int owner = p.div_slice.div(idx);
    push_f32(cluster_addr(push_o + rank * slice + (idx - owner * slice), owner), acc, cluster_addr(bar, owner));
    if (e == 0) {
      for (int c = 0; c < n_blocks; ++c) push_f32x2(cluster_addr(push_ml + (rank * R + r) * 2, c), mx, sum, cluster_addr(bar, c));
    }
  }
  mbarrier_wait(bar, 0);  // every block's bytes for this block have landed
  for (int idx = lo + int(threadIdx.x); idx < min(hi, live); idx += blockDim.x) {
    const OutElem o = out_elem(p, chunk, R, hkv, idx);
    const int r = o.r;
    float m_c[kMaxClusterSplits];
    float mx = kNegInf;
#pragma unroll
    for (int c = 0; c < kMaxClusterSplits; ++c) {
      m_c[c] = c < n_blocks ? push_ml[(c * R + r) * 2] : kNegInf;
      mx = max_nan(mx, m_c[c]);
    }
    float sum = 0.f, acc = 0.f;
    if (mx != kNegInf) {
#pragma unroll
      for (int c = 0; c < kMaxClusterSplits; ++c) {
        if (c < n_blocks) {
          const float w = fast_exp2(m_c[c] - mx);
          sum = fmaf(w, push_ml[(c * R + r) * 2 + 1], sum);
          acc = fmaf(w, push_o[c * slice + idx - lo], acc);
        }
      }
    }
    if (o.i >= nr.n) continue;  // ragged: not a token of the sequence (its zeros were pushed and merged all the same)
    out_at<T>(p, b, o.h, nr.row0 + o.i, o.e) = from_float<T>(sum == 0.f ? 0.f : acc / sum);
  }
#endif
}

}  // namespace decode

template <typename T, int HD, int R, bool kDeep, int NT, bool kPaged>
__global__ void __launch_bounds__(NT) decode_kernel(const DecodeParams p) {
  using G = DecodeGeometry<T, HD, NT>;
  using Tile = DecodeTile<T, HD, R, kDeep, NT>;
  constexpr int EPT = G::EPT, TX = G::TX, NY = G::NY;
  constexpr int U = Tile::U, TILE = Tile::TILE, STAGES = Tile::STAGES;
  constexpr int kWords = EPT * int(sizeof(T)) / 16;
  static_assert(TX <= 32 && 32 % TX == 0, "a key's threads sit in one warp");
  launch_dependents_early(p.pdl_early);  // pdl.cuh: every block waits below before it exits
  extern __shared__ __align__(16) unsigned char dsmem[];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) decode::cluster_merge_init(dsmem + Tile::kSmemBytes);  // phase 1 of decode::finish's merge
#endif
  // Shared memory (dynamic: DecodeTile::kSmemBytes, + kPushBytes with the cluster merge): first the K/V
  // pipeline, [stage][K or V][u][word][thread] (a thread's words are 16 bytes apart from its
  // neighbours': conflict-free), then, reused after the loop, the merge of the NW warps: o [R][NW][HD],
  // m and l [R][NW]; past both, the cluster merge's pushes.
  constexpr int NW = NT / 32;
  constexpr int kPipeBytes = STAGES * 2 * U * kWords * NT * 16;
  static_assert(Tile::kSmemBytes >= kPipeBytes && Tile::kSmemBytes >= (R * NW * HD + 2 * R * NW) * 4, "smem");
  uint4* const pipe = reinterpret_cast<uint4*>(dsmem);

  const int split = blockIdx.y;
  int bh, chunk, b, hkv;  // blockIdx.x = (b x nheads_kv + hkv) x row_chunks + chunk
  p.div_row_chunks.divmod(int(blockIdx.x), bh, chunk);
  p.div_nheads_kv.divmod(bh, b, hkv);
  const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
  const int e0 = tx * EPT;              // this thread's first element of a row
  const bool lane_on = e0 < p.headdim;  // headdim % 8 == 0: a slice is all in or all out
  const T* kc = static_cast<const T*>(p.k_cache) + decode::cache_base<kPaged>(b, p.k_stride_b) + hkv * p.k_stride_h + e0;
  const T* vc = static_cast<const T*>(p.v_cache) + decode::cache_base<kPaged>(b, p.v_stride_b) + hkv * p.v_stride_h + e0;
  decode::TileRows<kPaged, U, TILE> tile_rows;  // started once the split's range is known
  const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_stride_b + hkv * p.kn_stride_h + e0;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_stride_b + hkv * p.vn_stride_h + e0;
  auto word = [&](int stage, int kv, int u, int w) {
    return pipe + (((stage * 2 + kv) * U + u) * kWords + w) * NT + threadIdx.x;
  };
  int cached, end, start, kb, ke;  // the lengths; this split's keys: whole tiles of [start, end)
  // Slots >= cached come from k_new / v_new: the append below never races with these reads.
  // A tile wholly inside the cache and the split (all but at most two per block) takes the
  // short path: one 64-bit multiply-add per row, no selects.
  auto issue = [&](int t, auto clamp) {
    constexpr bool kClamp = decltype(clamp)::value;
    const int stage = t % STAGES;
    const int jt = kb + t * TILE;
    if (jt + TILE <= min(cached, ke)) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const T* ks;
        const T* vs;
        tile_rows.template at<kClamp>(p, min(cached, ke), u, jt + u * NY + ty, kc, vc, ks, vs);
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          cp_async16(word(stage, 0, u, w), ks + w * (16 / int(sizeof(T))), lane_on);
          cp_async16(word(stage, 1, u, w), vs + w * (16 / int(sizeof(T))), lane_on);
        }
      }
      return;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = jt + u * NY + ty;
      const bool on = lane_on && j < ke;
      const T* ks = static_cast<const T*>(p.k_cache);
      const T* vs = static_cast<const T*>(p.v_cache);
      if (on && j < cached) {
        tile_rows.template at<kClamp>(p, min(cached, ke), u, j, kc, vc, ks, vs);
      } else if (on) {
        ks = kn + (j - cached) * p.kn_stride_s;
        vs = vn + (j - cached) * p.vn_stride_s;
      }
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        cp_async16(word(stage, 0, u, w), ks + w * (16 / int(sizeof(T))), on);
        cp_async16(word(stage, 1, u, w), vs + w * (16 / int(sizeof(T))), on);
      }
    }
  };

  if constexpr (!kPaged) decode::prefetch_cache<T>(p, b, hkv, split, TILE);
  // Launched programmatically (pdl.cuh): q, k_new / v_new and the lengths may be the previous
  // kernel's outputs. The combine kernel (or the next op's kernel) may launch from here on.
  wait_for_primary();
  launch_dependents();

  // The sequence's new tokens (ragged: read from cu_seqlens_q; otherwise no load) locate its rows of the
  // packed q / k_new / v_new / out.
  const decode::NewRows nr = decode::new_rows(p, b);
  kn += nr.row0 * p.kn_stride_s;
  vn += nr.row0 * p.vn_stride_s;
  // The block's query rows, pre-scaled into the log2 domain (loaded before the lengths, which
  // they do not depend on: the two DRAM round trips overlap).
  float q[R][EPT];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int rr = chunk * R + r;
    const decode::RowHead rh = decode::row_head(p, hkv, rr);
    if (rr < p.rows && rh.i < nr.n && lane_on) {
      decode::Row<T, EPT> row;
      row.load(static_cast<const T*>(p.q) + b * p.q_stride_b + rh.h * p.q_stride_h +
               (nr.row0 + rh.i) * p.q_stride_s + e0);
      row.to_float(q[r]);
#pragma unroll
      for (int e = 0; e < EPT; ++e) q[r][e] *= p.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < EPT; ++e) q[r][e] = 0.f;
    }
  }

  // A paged block checks the entries of its own split's pages (pages_ok) after issuing its first tiles: those tiles
  // read through entries clamped into the pool (TileRows::at<true>), so the table's round trip is not on the path to
  // the first tile, and the loop uses the entries as loaded, unclamped: the tensor-core kernel's way (only the first
  // split checks, the others clamp every entry they use) made this kernel's loop 359-400 instructions a tile instead
  // of 345 (fp16, D64, paged, one row; nvcc 13.0) and its paged cache at batch 4, 32 heads, D64 4.5% / 6.7% slower at
  // 8k / 32k keys, where it issues from two warps a scheduler (H200, fp16, the two builds interleaved, 2026-11-29).
  // A bad entry there poisons the split's rows, which makes the merged rows NaN. The first split of chunk 0 checks
  // the rest of the sequence's entries after its loop, before the append, so no block waits for more than its own
  // split's entries before its loop. Every block checking every entry before its loop, against this (paged B1 MHA
  // 32 heads, H200, fp16, bench.ab, two interleaved rounds, 2026-11-30): D128 8k 42.8 -> 41.1 us, D128 32k 137.5 ->
  // 133.6, D64 32k 73.8 -> 71.4, D64 128k 256.8 -> 252.3 (contiguous 40.9 / 134.8 / 71.7 / 250.2). An empty pool has
  // no page to clamp into: bad lengths wherever a slot is read or written.
  if (!decode::lengths_ok(p, b, nr, cached, end, start) || (kPaged && p.num_pages <= 0 && end > start)) {
    decode::write_nan_rows<T, R>(p, chunk, b, hkv, split, nr);
    return;
  }
  // Ragged: a chunk with no token of the sequence (chunk 0's is its first, so nothing to append either).
  if (!decode::chunk_live<R>(p, chunk, nr)) return;
  decode::split_range(p, start, end, split, TILE, kb, ke);
  const int n_tiles = ke > kb ? (ke - kb + TILE - 1) / TILE : 0;
  tile_rows.start(p, b, kb + ty, NY, min(cached, ke), kc, vc);
#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < n_tiles) issue(t, std::true_type{});
    cp_async_commit();
  }
  // A bad entry among the split's own pages: no loop (the first tiles' copies land at its end), rows poisoned
  // (own_pages_ok, read again after the loop).
  const bool own_pages_ok = decode::pages_ok<kPaged>(p, b, kb, ke);
  const int tiles = own_pages_ok ? n_tiles : 0;
  const bool appends = p.k_new != nullptr && split == 0 && chunk == 0;
  if (!kPaged && appends) decode::append<T, kPaged>(p, b, hkv, cached, nr);

  int lim[R];  // first slot row r cannot see (causal among the sequence's nr.n new tokens; 0 for idle rows)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int rr = chunk * R + r, i = p.div_seqlen_new.mod(rr);
    lim[r] = rr < p.rows && i < nr.n ? end - nr.n + 1 + i : 0;
  }
  float m[R], l[R], o[R][EPT];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < EPT; ++e) o[r][e] = 0.f;
  }

  const bool* key_mask = p.key_mask != nullptr ? p.key_mask + b * p.key_mask_stride_b : nullptr;
  for (int t = 0; t < tiles; ++t) {
    if (t + STAGES - 1 < tiles) issue(t + STAGES - 1, std::false_type{});
    cp_async_commit();
    bool key_on[U];  // in the split, and not masked (read before the wait, so the two overlap)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = kb + t * TILE + u * NY + ty;
      key_on[u] = j < ke && (key_mask == nullptr || key_mask[j]);
    }
    cp_async_wait<STAGES - 1>();  // tile t has landed (this thread's part of it)
    const int stage = t % STAGES;
    float s[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      decode::Row<T, EPT> krow;
#pragma unroll
      for (int w = 0; w < kWords; ++w) krow.w[w] = *word(stage, 0, u, w);
      float kf[EPT];
      krow.to_float(kf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < EPT; ++e) acc = fmaf(q[r][e], kf[e], acc);
        s[r][u] = acc;
      }
    }
#pragma unroll
    for (int off = TX / 2; off > 0; off /= 2) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int r = 0; r < R; ++r) s[r][u] += __shfl_xor_sync(0xffffffffu, s[r][u], off);
      }
    }
    float vf[U][EPT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = kb + t * TILE + u * NY + ty;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!(key_on[u] && j < lim[r])) s[r][u] = kNegInf;
      }
      decode::Row<T, EPT> vrow;
#pragma unroll
      for (int w = 0; w < kWords; ++w) vrow.w[w] = key_on[u] ? *word(stage, 1, u, w) : make_uint4(0, 0, 0, 0);
      vrow.to_float(vf[u]);  // a masked slot's value is never multiplied in (0 * NaN would be NaN)
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = max_nan(mx, s[r][u]);
      if (mx == kNegInf) continue;  // nothing visible yet for this row
      if (mx > m[r]) {  // a new running max (rare after the first keys): rescale what is summed
        const float corr = fast_exp2(m[r] - mx);  // m == -inf: 0 (o and l are 0 anyway)
        m[r] = mx;
        l[r] *= corr;
#pragma unroll
        for (int e = 0; e < EPT; ++e) o[r][e] *= corr;
      }
      // A NaN score leaves m alone and makes pr, l and o NaN: the row comes out NaN.
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pr = fast_exp2(s[r][u] - m[r]);  // masked: exp2(-inf) = 0
        l[r] += pr;
#pragma unroll
        for (int e = 0; e < EPT; ++e) o[r][e] = fmaf(pr, vf[u][e], o[r][e]);
      }
    }
  }
  cp_async_wait<0>();
  if constexpr (kPaged) {
    // The first split of chunk 0 writes this step's rows only when every entry of the sequence's pages is in the
    // pool: its own were checked before the loop (its range starts at `start`), the rest now, behind the loop.
    bool ok = own_pages_ok;
    if (appends) {
      ok = decode::pages_ok<kPaged>(p, b, ke, end) && ok;
      if (ok) decode::append<T, kPaged>(p, b, hkv, cached, nr);
    }
    if (!ok) decode::poison(m);
  }

  // Merge the warp's 32 / TX key slots of each row with shuffles (lanes TX apart hold the same elements
  // of different keys), then the NW warps' results through shared memory (decode::finish).
  constexpr int NYW = 32 / TX;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float mw = m[r];
#pragma unroll
    for (int off = TX; off < 32; off *= 2) mw = max_nan(mw, __shfl_xor_sync(0xffffffffu, mw, off));
    const float corr = mw == kNegInf ? 0.f : fast_exp2(m[r] - mw);  // NaN stays NaN
    l[r] *= corr;
#pragma unroll
    for (int e = 0; e < EPT; ++e) o[r][e] *= corr;
#pragma unroll
    for (int off = TX; off < 32; off *= 2) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], off);
#pragma unroll
      for (int e = 0; e < EPT; ++e) o[r][e] += __shfl_xor_sync(0xffffffffu, o[r][e], off);
    }
    m[r] = mw;
  }
  __syncthreads();  // the merge below reuses the pipeline's shared memory
  float* sm_o = reinterpret_cast<float*>(dsmem);  // [R][NW][HD]
  float* sm_m = sm_o + R * NW * HD;               // [R][NW]
  float* sm_l = sm_m + R * NW;                    // [R][NW]
  if (ty % NYW == 0) {  // lanes 0 .. TX - 1 of the warp
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (tx == 0) {
        sm_m[r * NW + warp] = m[r];
        sm_l[r * NW + warp] = l[r];
      }
#pragma unroll
      for (int e = 0; e < EPT; ++e) sm_o[(r * NW + warp) * HD + e0 + e] = o[r][e];
    }
  }
  __syncthreads();
  decode::finish<T, R, NW, HD>(p, sm_o, sm_m, sm_l, dsmem + Tile::kSmemBytes, chunk, b, hkv, split, nr);
}


// ---------------------------------------------------------------------------------------------
// decode_mma_kernel: the same step on tensor cores, for float16 / bfloat16 and head dims 33..128,
// used when a block serves several query rows (GQA groups, several new tokens): the CUDA-core
// kernel above spends ~440 instructions per warp per 2 KB of K+V at 4 rows and cannot issue
// fast enough to stream. Here a block takes up to 16 query rows (an mma.sync m16n8k16 A tile,
// padded with zero rows) and 64 keys per stage, 16 per warp: S = Q·Kᵀ as 2 x (HD / 16) MMAs
// from ldmatrix'ed K, the online softmax on the accumulator fragments (rows g and g + 8 of each
// lane, reduced over the lane quad), P packed into the A fragment of P·V as FlashAttention-2
// does, and O += P·V as HD / 8 MMAs from ldmatrix.trans'ed V. K and V stream through a
// multi-stage cp.async pipeline in shared memory (rows XOR-swizzled by 16-byte chunk so ldmatrix
// is conflict-free). The 4 warps' partial results merge through decode::finish, as above.
template <typename T, int HD, bool kPaged>
struct DecodeMmaGeometry {
  static constexpr int TILE = 64;  // keys per stage, 16 per warp
  static constexpr int CH = HD / 8;  // 16-byte chunks per row
  static constexpr int kStageBytes = 2 * TILE * HD * int(sizeof(T));
  static constexpr int STAGES = kStageBytes <= 16384 ? 4 : 3;
  static constexpr int kPipeBytes = STAGES * kStageBytes;
  static constexpr int kMergeBytes = (16 * 4 * HD + 2 * 16 * 4) * 4;  // o [16][4 warps][HD], m and l [16][4]
  static constexpr int kQOffset = kPipeBytes > kMergeBytes ? kPipeBytes : kMergeBytes;
  // A paged cache's first split stages its check's first block_table loads here (decode::PageCheck): 2 KB at
  // kDecodePagesEarly = 1, within what keeps three blocks an SM at D64 and two at D128 with the cluster merge's push
  // area (3 KB to spare a block at either, H200: 228 KB an SM).
  static constexpr int kCheckOffset = kQOffset + 16 * HD * int(sizeof(T));
  static constexpr int kSmemBytes = kCheckOffset + (kPaged ? kDecodePagesEarly * kDecodeThreads * 16 : 0);
};


// At D64 a paged cache's first split keeps a few values through the loop for its check and append after it
// (decode::PageCheck); left to itself nvcc 13.0 held that kernel at 128 registers and recomputed the loop's
// shared-memory addresses every tile (main loop 787 -> 832 SASS instructions, sm_90a). Three blocks an SM (170
// registers) is what the shared memory holds there anyway. Elsewhere 0: no minimum, nvcc's own choice (a minimum of
// 3 made D128 paged spill 8 bytes).
template <typename T, int HD, bool kPaged>
__global__ void __launch_bounds__(kDecodeThreads, kPaged && HD <= 64 ? 3 : 0) decode_mma_kernel(const DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using M = DecodeMmaGeometry<T, HD, kPaged>;
  constexpr int TILE = M::TILE, CH = M::CH, STAGES = M::STAGES, R = 16, NW = kDecodeThreads / 32;
  constexpr int kVec = 8;  // elements per 16-byte chunk
  extern __shared__ __align__(128) unsigned char smem[];
  T* const pipe = reinterpret_cast<T*>(smem);  // [stage][K, V][TILE][HD], swizzled
  T* const sq = reinterpret_cast<T*>(smem + M::kQOffset);  // [16][HD], swizzled
  launch_dependents_early(p.pdl_early);  // as in decode_kernel
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) decode::cluster_merge_init(smem + M::kSmemBytes);  // phase 1 of decode::finish's merge
#endif

  const int split = blockIdx.y;
  int bh, chunk, b, hkv;  // blockIdx.x = (b x nheads_kv + hkv) x row_chunks + chunk
  p.div_row_chunks.divmod(int(blockIdx.x), bh, chunk);
  p.div_nheads_kv.divmod(bh, b, hkv);
  // A paged cache is not prefetched: the prefetch waits on its block_table loads before the block goes on, and the
  // first tiles' copies wait on the same entries again. Without it, paged B1 GQA 64/8 D128 8k 25.7 -> 24.0 us,
  // 32/8 D128 8k 23.1 -> 22.4, 32/8 D64 32k 30.1 -> 29.4; B4 0.5-2% (D64 8k even; H200, fp16, the op alone,
  // bench.ab, 2026-11-30; the CUDA-core kernel's likewise: decode_kernel). Under a PDL chain the prefetch would
  // overlap the previous kernel; not measured there.
  if constexpr (!kPaged) decode::prefetch_cache<T>(p, b, hkv, split, TILE);
  wait_for_primary();
  launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const decode::NewRows nr = decode::new_rows(p, b);  // as in decode_kernel

  // Q rows of this chunk into shared memory (zero rows past p.rows or past the sequence's tokens, zero
  // columns past headdim), copied in a commit group of their own: the lengths' loads below go out at once instead
  // of behind a load and a shared store of Q (decode_kernel holds Q in registers for the same reason). Paged B1
  // GQA 32/8 D64 8k 16.1 -> 15.6 us; contiguous and the other GQA cases within 0.7% (H200, fp16, bench.ab against
  // the shared store, two interleaved rounds, 2026-11-30).
  for (int i = threadIdx.x; i < R * CH; i += kDecodeThreads) {
    const int r = i / CH, c = i % CH, rr = chunk * R + r;
    const decode::RowHead rh = decode::row_head(p, hkv, rr);
    const bool on = rr < p.rows && rh.i < nr.n && c * kVec < p.headdim;
    const T* src = static_cast<const T*>(p.q);
    if (on) src += b * p.q_stride_b + rh.h * p.q_stride_h + (nr.row0 + rh.i) * p.q_stride_s + c * kVec;
    cp_async16(reinterpret_cast<uint4*>(sq + swizzled<HD>(r, c)), src, on);
  }
  cp_async_commit();

  int cached, end, start;
  const bool lengths = decode::read_lengths<kPaged>(p, b, nr, cached, end, start);
  if (!decode::chunk_live<R>(p, chunk, nr)) {  // as in decode_kernel, once Q's zero fills have landed
    cp_async_wait<0>();
    return;
  }
  int kb, ke;
  decode::split_range(p, start, end, split, TILE, kb, ke);
  const int n_tiles = ke > kb ? (ke - kb + TILE - 1) / TILE : 0;

  const T* kc = static_cast<const T*>(p.k_cache) + decode::cache_base<kPaged>(b, p.k_stride_b) + hkv * p.k_stride_h;
  const T* vc = static_cast<const T*>(p.v_cache) + decode::cache_base<kPaged>(b, p.v_stride_b) + hkv * p.v_stride_h;
  const T* kn = static_cast<const T*>(p.k_new) + b * p.kn_stride_b + hkv * p.kn_stride_h + nr.row0 * p.kn_stride_s;
  const T* vn = static_cast<const T*>(p.v_new) + b * p.vn_stride_b + hkv * p.vn_stride_h + nr.row0 * p.vn_stride_s;
  // Each thread copies one fixed 16-byte column chunk c of rows r0, r0 + RS, ...; a tile wholly
  // inside the cache and the split takes the short path (no selects).
  constexpr int RS = kDecodeThreads / CH;
  const int c = threadIdx.x % CH, r0 = threadIdx.x / CH;
  constexpr int N = TILE / RS;  // rows a thread copies a tile
  static_assert(N <= 16, "a thread's run of a tile lies in at most two pages of the smallest size (16 slots)");
  decode::TileRun<kPaged, N, TILE> tile_run;
  tile_run.start(p, b, kb + r0 * N, min(cached, ke), kc, vc);
  const bool col_on = c * kVec < p.headdim;
  const int cv = col_on ? c * kVec : 0;  // a padding chunk's copy reads nothing; its address stays in its row
  // A contiguous cache's rows of a thread lie at fixed byte steps: row r0 + n x RS of tile t is the split's row r0
  // plus (t x N + n) steps of RS rows.
  const uint64_t k_step = uint64_t(RS) * uint64_t(p.k_stride_l) * sizeof(T);
  const uint64_t v_step = uint64_t(RS) * uint64_t(p.v_stride_l) * sizeof(T);
  const uint64_t k_row0 = reinterpret_cast<uint64_t>(kc + int64_t(kb + r0) * p.k_stride_l + cv);
  const uint64_t v_row0 = reinterpret_cast<uint64_t>(vc + int64_t(kb + r0) * p.v_stride_l + cv);
  auto issue = [&](int t) {
    T* ks = pipe + (t % STAGES) * 2 * TILE * HD;
    T* vs = ks + TILE * HD;
    const int jt = kb + t * TILE;
    const bool fast = jt + TILE <= min(cached, ke);
    const auto run = tile_run.run(p, jt + r0 * N);
    // A full tile (every row in the cache and the split) in a loop of its own: one address a row, no per-row
    // tests. Before, every row took the general path's tests and a 64-bit j x stride multiply for K and V (~35
    // instructions a row, ~300 of a contiguous tile's 16 copies; ~70 now): contiguous up to 12% faster (B16 GQA
    // 32/8 D128 128k 1929.8 -> 1881.6 us, B1 32/8 D128 8k 24.5 -> 21.5), paged up to 9% (H200, fp16, bench.ab
    // against the tree before, 2026-11-30). The paged runs' selects dropped as well (one page: row strides from the
    // first row) measured even (34 of 36 cases within 0.7%), so the paged rows stay TileRun::at's.
    if (fast) {
      uint64_t ka = k_row0 + uint64_t(t) * N * k_step, va = v_row0 + uint64_t(t) * N * v_step;
#pragma unroll
      for (int n = 0; n < N; ++n) {
        const int row = kPaged ? r0 * N + n : r0 + n * RS;
        const T* ksrc;
        const T* vsrc;
        if constexpr (kPaged) {
          tile_run.at(p, run, n, jt + row, kc, vc, ksrc, vsrc);
          ksrc += cv;
          vsrc += cv;
        } else {
          ksrc = reinterpret_cast<const T*>(ka);
          vsrc = reinterpret_cast<const T*>(va);
          ka += k_step;
          va += v_step;
        }
        cp_async16(reinterpret_cast<uint4*>(ks + swizzled<HD>(row, c)), ksrc, col_on);
        cp_async16(reinterpret_cast<uint4*>(vs + swizzled<HD>(row, c)), vsrc, col_on);
      }
    } else {
#pragma unroll
      for (int n = 0; n < N; ++n) {
        const int row = kPaged ? r0 * N + n : r0 + n * RS, j = jt + row;
        const bool on = col_on && j < ke;
        const T* ksrc = static_cast<const T*>(p.k_cache);
        const T* vsrc = static_cast<const T*>(p.v_cache);
        if (on && j < cached) {
          tile_run.at(p, run, n, j, kc, vc, ksrc, vsrc);
          ksrc += c * kVec;
          vsrc += c * kVec;
        } else if (on) {
          ksrc = kn + (j - cached) * p.kn_stride_s + c * kVec;
          vsrc = vn + (j - cached) * p.vn_stride_s + c * kVec;
        }
        cp_async16(reinterpret_cast<uint4*>(ks + swizzled<HD>(row, c)), ksrc, on);
        cp_async16(reinterpret_cast<uint4*>(vs + swizzled<HD>(row, c)), vsrc, on);
      }
    }
    tile_run.next(p, jt + r0 * N, min(cached, ke));
  };
  // The first split's check of the sequence's entries: its first loads go out first, in the first tile's commit
  // group (the loop waits for that one first anyway); its verdict comes after the loop, and the append (the first
  // split's) waits for it.
  decode::PageCheck<kPaged> check;
  uint4* const check_stage = reinterpret_cast<uint4*>(smem + M::kCheckOffset);
  if (split == 0) check.issue(p, b, start, end, check_stage);
#pragma unroll
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < n_tiles) issue(t);
    cp_async_commit();
  }
  // A contiguous cache has nothing to check: its append goes out here, under the first tiles.
  const bool appends = p.k_new != nullptr && split == 0 && chunk == 0;  // this block writes the new rows
  if (!kPaged && lengths && appends) decode::append<T, kPaged>(p, b, hkv, cached, nr);
  cp_async_wait<STAGES - 1>();  // Q's group: the first of STAGES, the tiles' behind it
  __syncthreads();  // Q in shared memory

  uint32_t qa[HD / 16][4];  // A fragments of Q, one per 16 columns
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    const int row = (lane / 8 % 2) * 8 + lane % 8, c = ks * 2 + lane / 16;
    ldmatrix_x4(qa[ks], smem_addr(sq + swizzled<HD>(row, c)));
  }
  int lim[2];  // first slot rows g and g + 8 cannot see (0 for padding rows)
  int plain_end = ke;  // tiles ending by here hide no key from this lane's live rows (padding rows: not read out)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = chunk * R + g + 8 * h, i = p.div_seqlen_new.mod(rr);
    const bool live = rr < p.rows && i < nr.n;
    lim[h] = live ? end - nr.n + 1 + i : 0;
    if (live) plain_end = min(plain_end, lim[h]);
  }
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const bool* key_mask = p.key_mask != nullptr ? p.key_mask + b * p.key_mask_stride_b : nullptr;

  for (int t = 0; t < n_tiles; ++t) {
    const int jt = kb + t * TILE;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t landed for every thread; the stage tile t - 1 used is free
    if (t + STAGES - 1 < n_tiles) issue(t + STAGES - 1);
    cp_async_commit();
    const T* ks = pipe + (t % STAGES) * 2 * TILE * HD;
    T* vs = const_cast<T*>(ks) + TILE * HD;
    if (key_mask != nullptr) {  // a masked slot's value is zeroed: P = 0 times NaN would be NaN
      for (int i = threadIdx.x; i < TILE * CH; i += kDecodeThreads) {
        const int row = i / CH, j = jt + row;
        if (j < ke && !key_mask[j]) *reinterpret_cast<uint4*>(vs + swizzled<HD>(row, i % CH)) = make_uint4(0, 0, 0, 0);
      }
      __syncthreads();
    }
    // S = Q·Kᵀ over this warp's 16 keys: two n-tiles of 8 keys.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t kf[4];
      const int key = warp * 16 + (lane / 16) * 8 + lane % 8, c = kk * 2 + lane / 8 % 2;
      ldmatrix_x4(kf, smem_addr(ks + swizzled<HD>(key, c)));
      mma16816<T>(s[0], qa[kk], kf[0], kf[1]);
      mma16816<T>(s[1], qa[kk], kf[2], kf[3]);
    }
    // Scale into the log2 domain; -inf where a key is outside the split, masked, or causally hidden. A tile
    // inside the split and every live row's causal limit, with no key_mask (all but the last tiles of a split in
    // a decode step), hides nothing: it is only scaled (8 multiplies a lane, where the masking is ~70 instructions
    // and 8 convergence barriers; nvcc 13.0, D64). Against masking every tile: contiguous B1 GQA 32/8 D64 8k
    // 16.0 -> 14.2 us, B1 64/8 D128 8k 22.4 -> 21.4, B4 32/8 D64 128k 251.4 -> 248.2, B16 D128 within 0.4%
    // (H200, fp16, bench.ab, two interleaved rounds, 2026-11-30).
    if (key_mask == nullptr && jt + TILE <= plain_end) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= p.scale_log2;
      }
    } else {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = jt + warp * 16 + n * 8 + 2 * t4 + (e & 1);
          const bool on = j < ke && j < lim[e / 2] && (key_mask == nullptr || key_mask[j]);
          s[n][e] = on ? s[n][e] * p.scale_log2 : kNegInf;
        }
      }
    }
    float pr[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // rows g (h = 0) and g + 8 (h = 1)
      float mx = max_nan(max_nan(s[0][2 * h], s[0][2 * h + 1]), max_nan(s[1][2 * h], s[1][2 * h + 1]));
      mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = max_nan(m[h], mx);
      const float base = mn == kNegInf ? 0.f : mn;  // nothing visible yet: every p is 0
      if (mn != m[h]) {  // a new running max: rescale what is summed (NaN compares unequal: poisons)
        const float corr = fast_exp2(m[h] - base);
        l[h] *= corr;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
          o[n][2 * h] *= corr;
          o[n][2 * h + 1] *= corr;
        }
        m[h] = mn;
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        pr[n][2 * h] = fast_exp2(s[n][2 * h] - base);
        pr[n][2 * h + 1] = fast_exp2(s[n][2 * h + 1] - base);
        l[h] += pr[n][2 * h] + pr[n][2 * h + 1];
      }
    }
    // P as the A fragment of P·V (k = this warp's 16 keys), in T as FlashAttention does.
    const uint32_t pa[4] = {pack2<T>(pr[0][0], pr[0][1]), pack2<T>(pr[0][2], pr[0][3]),
                            pack2<T>(pr[1][0], pr[1][1]), pack2<T>(pr[1][2], pr[1][3])};
#pragma unroll
    for (int nc = 0; nc < HD / 16; ++nc) {
      uint32_t vf[4];
      const int key = warp * 16 + (lane / 8 % 2) * 8 + lane % 8, c = nc * 2 + lane / 16;
      ldmatrix_x4_trans(vf, smem_addr(vs + swizzled<HD>(key, c)));
      mma16816<T>(o[2 * nc], pa, vf[0], vf[1]);
      mma16816<T>(o[2 * nc + 1], pa, vf[2], vf[3]);
    }
  }
  cp_async_wait<0>();
  // Whether the rows come out as computed: the lengths are in bounds and, in the first split of a paged cache,
  // every entry of the sequence's pages is in the pool. Not ok: the rows are poisoned and nothing is appended.
  const bool ok = lengths && (split != 0 || check.ok(p, b, start, end, check_stage));
  if (kPaged && ok && appends) decode::append<T, kPaged>(p, b, hkv, cached, nr);
  __syncthreads();  // the merge below reuses the pipeline's shared memory
  if (!ok) decode::poison<2>(m);

  // Each warp is one key slot of decode::finish: rows g and g + 8 of this lane, columns 2 t4 (+1) of
  // each 8-column n-tile; l summed over the lane quad first.
  float* sm_o = reinterpret_cast<float*>(smem);  // [16][NW][HD]
  float* sm_m = sm_o + R * NW * HD;              // [16][NW]
  float* sm_l = sm_m + R * NW;                   // [16][NW]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int row = g + 8 * h;
    if (t4 == 0) {
      sm_m[row * NW + warp] = m[h];
      sm_l[row * NW + warp] = l[h];
    }
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      sm_o[(row * NW + warp) * HD + n * 8 + 2 * t4] = o[n][2 * h];
      sm_o[(row * NW + warp) * HD + n * 8 + 2 * t4 + 1] = o[n][2 * h + 1];
    }
  }
  __syncthreads();
  decode::finish<T, R, NW, HD>(p, sm_o, sm_m, sm_l, smem + M::kSmemBytes, chunk, b, hkv, split, nr);
#endif
}

// One block per output row (b, h, i): merges the num_splits partial rows. The split weights go through shared memory
// first; then thread t sums four columns (4 (t % Q) .., Q = headdim / 4) over every P-th split (P = 128 / Q, from t
// / Q), its 16-byte loads independent and unrolled, so a row's partials arrive in one or two L2 round trips, and the
// P sums of a column meet in shared memory. A split of weight 0 (empty: its partial never written) adds nothing
// whatever its memory holds. A block of the attention kernels with out-of-bounds lengths or pages makes its partial
// NaN (decode::poison; decode_kernel's write_nan_rows), so the merge needs no check of its own. The first version
// chained a load of lse and of o per split (~0.5 us of L2 latency a split, 15 us at 33 splits); one column a thread,
// the loads behind a branch on the weight: 16.3 us at B1 GQA 32/8 D64 32k keys (49 splits), cuDNN's reduction 4.3
// (H200, fp16, Nsight Compute, cold caches).
template <typename T>
__global__ void __launch_bounds__(128) decode_combine_kernel(const DecodeParams p) {
  __shared__ float sm_w[256];  // kMaxSplits: the weight 2^(lse_s - max) of each split
  __shared__ float sm_sum;
  __shared__ float4 sm_acc[128];  // thread t's sums of its four columns
  launch_dependents_early(p.pdl_early);  // pdl.cuh
  wait_for_primary();  // the partials are the attention kernel's: complete and visible after this
  const int64_t row = blockIdx.x;  // (b x nheads_q + h) x seqlen_new + i, below 2**31 (the grid's x)
  const int64_t n_rows = int64_t(p.batch) * p.nheads_q * p.seqlen_new;
  int bh, i, b, h;
  p.div_seqlen_new.divmod(int(row), bh, i);
  p.div_nheads_q.divmod(bh, b, h);
  const decode::NewRows nr = decode::new_rows(p, b);
  if (i >= nr.n) return;  // ragged: not a token of the sequence (its partials were never written)
  T* out = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h + (nr.row0 + i) * p.o_stride_s;
  const int t = int(threadIdx.x);
  for (int s = t; s < p.num_splits; s += blockDim.x) sm_w[s] = p.partial_lse[s * n_rows + row];
  __syncthreads();
  if (t < 32) {
    float mx = kNegInf;
    for (int s = t; s < p.num_splits; s += 32) mx = max_nan(mx, sm_w[s]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.f;
    for (int s = t; s < p.num_splits; s += 32) {
      const float w = mx == kNegInf ? 0.f : fast_exp2(sm_w[s] - mx);  // an empty split: lse -inf, weight 0
      sm_w[s] = w;
      sum += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (t == 0) sm_sum = sum;
  }
  __syncthreads();
  // Thread t: columns col .. col + 3 of every parts-th split from `part`; headdim % 8 == 0, <= 256: parts >= 2.
  const int q_cols = p.headdim / 4, parts = p.div_headdim.div(4 * int(blockDim.x));
  int part, col;
  p.div_headdim.divmod(4 * t, part, col);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (part < parts) {
    const float* po = p.partial_o + row * p.headdim + col;
#pragma unroll 8
    for (int s = part; s < p.num_splits; s += parts) {
      const float w = sm_w[s];
      const float4 v = *reinterpret_cast<const float4*>(po + s * n_rows * p.headdim);
      const bool on = w != 0.f;  // NaN weights (a poisoned split) take the value: the row stays NaN
      acc.x = fmaf(w, on ? v.x : 0.f, acc.x);
      acc.y = fmaf(w, on ? v.y : 0.f, acc.y);
      acc.z = fmaf(w, on ? v.z : 0.f, acc.z);
      acc.w = fmaf(w, on ? v.w : 0.f, acc.w);
    }
  }
  sm_acc[t] = acc;
  __syncthreads();
  if (t < q_cols) {
    float4 sum4 = sm_acc[t];
    for (int k = 1; k < parts; ++k) {
      const float4 o = sm_acc[k * q_cols + t];
      sum4.x += o.x;
      sum4.y += o.y;
      sum4.z += o.z;
      sum4.w += o.w;
    }
    const float sum = sm_sum;
    const float c[4] = {sum4.x, sum4.y, sum4.z, sum4.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      out[4 * t + e] = from_float<T>(sum > 0.f ? c[e] / sum : (sum == 0.f ? 0.f : sum));  // NaN stays NaN
    }
  }
}

// The attention kernels' launch: a cluster of the splits when p.cluster, programmatic (pdl.cuh)
// when p.programmatic; the kernel allowed its shared memory and cluster size first (common/func_attrs.h).
template <typename Kernel>
void launch_attention_kernel(const DecodeParams& params, Kernel kernel, int smem, cudaStream_t stream,
                             int threads = kDecodeThreads) {
  allow_dynamic_smem(kernel, smem);
  if (params.cluster && params.num_splits > 8) allow_large_clusters(kernel);
  const DecodeParams p = with_pdl_early(params, params.batch);
  launch_clustered(p.programmatic, dim3(1, p.cluster ? unsigned(p.num_splits) : 1u, 1), kernel,
                   dim3(unsigned(p.batch) * p.nheads_kv * p.row_chunks, p.num_splits), dim3(unsigned(threads)), smem,
                   stream, p);
}

template <typename T, int HD, int R, bool kPaged>
void launch_decode(const DecodeParams& p, cudaStream_t stream) {
  // The deep and wide builds (one row per block) where decode_attention_heuristics.h takes them; the
  // paged cache has the 128-thread build only (the deep and wide builds were chosen on the contiguous
  // cache's GPT-2 step; one build keeps the paged units as small as the contiguous ones' main build).
  constexpr bool kHasDeep = kDecodeDeep && R == 1 && !kPaged;
  using Deep = DecodeTile<T, HD, R, true>;
  const int64_t split_slots = (int64_t(p.max_len) + p.num_splits - 1) / p.num_splits;
  const bool deep =
      kHasDeep && decode_deep(p.batch, pdl_early(p.batch), split_slots, int64_t(Deep::STAGES) * Deep::TILE);
  constexpr int kWide = R == 1 && !kPaged ? kDecodeWideThreads : kDecodeThreads;
  const bool wide = kWide != kDecodeThreads && !deep && decode_wide(p.batch, p.max_len);
  const auto kernel = wide   ? decode_kernel<T, HD, R, false, kWide, kPaged>
                      : deep ? decode_kernel<T, HD, R, kHasDeep, kDecodeThreads, kPaged>
                             : decode_kernel<T, HD, R, false, kDecodeThreads, kPaged>;
  const int body = wide ? DecodeTile<T, HD, R, false, kWide>::kSmemBytes
                   : deep ? Deep::kSmemBytes
                          : DecodeTile<T, HD, R>::kSmemBytes;
  const int smem = body + (p.cluster ? decode::kPushBytes<R, HD> : 0);
  launch_attention_kernel(p, kernel, smem, stream, wide ? kWide : kDecodeThreads);
}

template <typename T, int HD, int R>
bool decode_cluster_capable() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, decode_kernel<T, HD, R, false, kDecodeThreads, false>) == cudaSuccess &&
         attr.binaryVersion >= 90;
}

template <typename T, int HD, bool kPaged>
void launch_decode_mma(const DecodeParams& p, cudaStream_t stream) {
  using M = DecodeMmaGeometry<T, HD, kPaged>;
  const int smem = M::kSmemBytes + (p.cluster ? decode::kPushBytes<16, HD> : 0);
  launch_attention_kernel(p, decode_mma_kernel<T, HD, kPaged>, smem, stream);
}

// read() on the current device, kept in known[device][key] after the first call (stored + 1: 0 is not read yet).
// 0 where the device cannot be told or is past the table, or the key is outside it.
constexpr int kDecodeDevices = 64;
template <int K, typename Read>
int read_once_per_device(std::atomic<int> (&known)[kDecodeDevices][K], int key, Read read) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= kDecodeDevices || key < 0 || key >= K) {
    (void)cudaGetLastError();
    return 0;
  }
  if (const int n = known[device][key].load(std::memory_order_relaxed); n > 0) return n - 1;
  const int n = read();
  known[device][key].store(n + 1, std::memory_order_relaxed);
  return n;
}

// decode_mma_kernel's shared memory with the cluster merge's push area (the most a launch takes), allowed on the
// kernel: what its occupancy queries ask about.
template <typename T, int HD, bool kPaged>
int decode_mma_occupancy_smem() {
  const int smem = DecodeMmaGeometry<T, HD, kPaged>::kSmemBytes + decode::kPushBytes<16, HD>;
  allow_dynamic_smem(decode_mma_kernel<T, HD, kPaged>, smem);
  return smem;
}

template <typename T, int HD, bool kPaged>
int decode_mma_max_active_clusters(int splits) {
  static std::atomic<int> known[kDecodeDevices][kMaxClusterSplits + 1];
  if (splits < 1) return 0;
  return read_once_per_device(known, splits, [splits] {
    const auto kernel = decode_mma_kernel<T, HD, kPaged>;
    const int smem = decode_mma_occupancy_smem<T, HD, kPaged>();
    allow_large_clusters(kernel);
    return max_active_clusters(kernel, dim3(1, unsigned(splits), 1), kDecodeThreads, size_t(smem));
  });
}

template <typename T, int HD, bool kPaged>
int decode_mma_max_blocks_per_sm() {
  static std::atomic<int> known[kDecodeDevices][1];
  return read_once_per_device(known, 0, [] {
    const int smem = decode_mma_occupancy_smem<T, HD, kPaged>();
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_mma_kernel<T, HD, kPaged>, kDecodeThreads,
                                                      size_t(smem)) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 0;
    }
    return n;
  });
}

template <typename T, int HD>
int decode_mma_arch() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, decode_mma_kernel<T, HD, false>) == cudaSuccess ? attr.binaryVersion : 0;
}

template <typename T>
void launch_decode_combine(const DecodeParams& params, bool programmatic, cudaStream_t stream) {
  const DecodeParams p = with_pdl_early(params, params.batch);
  launch_programmatic(programmatic, decode_combine_kernel<T>, dim3(unsigned(int64_t(p.batch) * p.nheads_q * p.seqlen_new)),
                      dim3(128), 0, stream, p);
}

template <typename T>
int decode_combine_arch() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, decode_combine_kernel<T>) == cudaSuccess ? attr.binaryVersion : 0;
}

}  // namespace fused_attn
