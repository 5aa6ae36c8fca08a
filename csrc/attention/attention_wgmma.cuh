// attention_flash_wgmma_kernel: mode "flash" on Hopper (sm_90a builds, float16 / bfloat16, padded
// head dim 64 or 128): the same FlashAttention-2 forward as attention_flash_kernel
// (attention_kernel.cuh: same semantics, masks, GQA, lse, strided views) with its two GEMMs on
// the warpgroup MMA (wgmma), which mma.sync cannot reach on Hopper (FlashAttention-3's first step).
//
// One block = a loader warpgroup and 1 or 2 consumer warpgroups x 64 query rows (BR 64 or 128); keys
// in tiles of BC 64 or 128 (FlashAttention-3's warp specialization, with cp.async in place of TMA). The
// loader (24 registers after setmaxnreg) copies Q, then K and V of each tile into a ring of 3
// stages in the 128-byte-swizzled panel layout wgmma reads through descriptors
// (csrc/common/wgmma.cuh), announcing each stage on an mbarrier (`full`) and refilling it once
// every consumer handed it back (`empty`); no block barrier after the start, so the consumers do
// not run in step. Per key tile t a consumer issues S_t (64 x BC) = Q·K_tᵀ as HD / 16 wgmma
// m64nBCk16 from shared memory (both K-major), and behind it on the tensor cores the previous
// tile's O += P_{t-1}·V_{t-1} (BC / 16 wgmma m64nHDk16, P from registers as the A operand, V
// [keys][HD] read MN-major: the transpose bit); the online softmax of S_t (the helpers the
// mma.sync kernel uses: per warp, a wgmma m64nN accumulator is its 16 rows' m16n8 fragments)
// runs while that P·V does (FA3's intra-warpgroup overlap); O is rescaled once it is done and
// stage t - 1 handed back. Two consumers take turns issuing their MMAs (named barriers: FA3's
// ping-pong), so one's softmax runs under the other's MMAs. Under causal, key tiles past a block's
// last visible key are never loaded and a consumer skips the tiles past its own rows' last visible key.
//
// Tiles (kTile, FlashWgmmaConfig; head dim 128 has tile 0 only):
//   0: BR 128 (2 consumers, ping-pong), BC 128, 1 block per SM, consumers at 240 registers.
//   1: BR 128, BC 64, 2 blocks per SM: 80 registers per thread on entry, 104 for the consumers (ptxas:
//      32 bytes of spill); BC 64 halves the causal diagonal's masked work.
//   2: BR 64 (1 consumer, no ping-pong), BC 128, 2 blocks per SM: 128 on entry, 232 for the consumer;
//      twice tile 0's blocks, and the other block on an SM takes the ping-pong partner's role.
// At head dim 64 the tile is chosen per call (attention_heuristics.h's flash_d64_tile): tile 1 under
// causal where the grid has more 128-row blocks than the device has SMs, else tile 2. On an H100 (fp16,
// H12, bench_attention) tile 1 is the fastest at B8 causal S512 / S1024 (384-768 blocks: one block's
// pipeline fill overlaps the other's tiles, and BC 64 halves the diagonal's masked work), tile 2 at every
// other GPT-2 shape (B1: 48-96 blocks of 128 rows on 132 SMs, twice as many of 64), tile 0 at none of
// them: head dim 64 is built in tiles 1 and 2, and tile 0 is the head dim 128 kernel.
//
// Each tile and loader is built twice, with and without an attn_mask (kMask): the unmasked build has
// none of the mask's per-score code (two thirds of the SASS: docs/lab-notes/attention.md).
//
// Block order (flash_wgmma_block; attention_heuristics.h's flash_longest_first): under causal the query tiles
// go out longest-first across every (head, batch): all the last tiles (the most key tiles, bottom-right
// aligned also when seqlen_q != seqlen_k) at the lowest block ids, the tiles that see no key at the
// highest (FlashAttention-2/3's causal order). In the natural order (each (head, batch)'s tiles in turn,
// the mma.sync kernel's) the long tiles of the last heads start in the last wave, where blocks of very
// unequal length can leave SMs idle; B8 H12 S512 D64 causal ran at 0.90x SDPA's flash backend in it
// (H100, bench_attention; 1.05x with longest-first). Without causal the tiles are equal and the natural
// order stays (consecutive blocks share a head's K and V in L2); also past 8 waves of blocks, where the
// blocks in flight would span every head and re-read K and V from DRAM (H32 D128 S16384 causal: +4..7%
// longest-first).
//
// Loads by TMA (kTma, FA3's other loader; attention_heuristics.h's kFlashTma, where q, k and v allow it): one
// thread of the loader warpgroup issues each tile as HD / 64 tensor copies per matrix (a box of 64
// columns x the tile's rows of one (batch, head): common/tma.h), which land in the same 128-byte
// swizzled panels the cp.async loader writes (TMA's SWIZZLE_128B puts 16-byte chunk j of box row r at
// chunk j ^ (r % 8) of a 128-byte row, sw128_offset's layout for a 1024-byte aligned panel), zeros past
// the rows and the head dim; the stage's `full` barrier counts the bytes (expect_tx) instead of 128
// arrivals. The consumers are the same code. Against cp.async: one instruction per 16 KB panel instead
// of 8 per thread per panel, no loader registers for addresses, no L1 round trip; the copy engine
// runs ahead on its own.
//
// Traffic as attention_flash_kernel: Q and O once, K and V once per BR-row query tile (from L2
// after the first), so the kernel is tensor-core bound at seqlen >= ~512; the target is 4 · Sq ·
// Sk · D FLOPs (half under causal) at >= 0.8x cuDNN (~420 TFLOP/s on an H100 at D 128).
//
// Tests: tests/test_attention.py (mode "flash_wgmma" pins this kernel, "flash_mma" the other);
// quick check and timing: bench/check_flash_wgmma.py; benchmark: bench/bench_attention.py.
#pragma once

#include <type_traits>

#include "../common/func_attrs.h"
#include "../common/tma.h"
#include "../common/wgmma.cuh"
#include "attention_heuristics.h"
#include "attention_kernel.cuh"

namespace fused_attn {

// The TMA loader's tensor maps of q, k and v (boxes of 64 columns x BR rows for q, x BC rows for k and
// v); unused (zeros) by the cp.async loader.
struct FlashTmaMaps {
  CUtensorMap q, k, v;
};

template <typename T, int HD, int kTile>
struct FlashWgmmaConfig {
  static_assert(HD == 64 || HD == 128, "the wgmma kernel is built for head dims 64 and 128");
  static_assert(kTile == 0 || (HD == 64 && (kTile == 1 || kTile == 2)), "tiles 0-2 at head dim 64, 0 at 128");
  static constexpr int kConsumers = kTile == 2 ? 1 : 2;    // warpgroups of 64 query rows
  static constexpr int kThreads = 128 * (1 + kConsumers);  // warpgroup 0 loads
  static constexpr int BR = 64 * kConsumers;
  static constexpr int BC = kTile == 1 ? 64 : 128;
  static constexpr int STAGES = 3;  // K + V tiles: 3 x 64 KB at HD 128 (224 KB with Q)
  static constexpr int kBlocksPerSm = kTile == 0 ? 1 : 2;
  // Registers per thread at launch: 65536 / kThreads / kBlocksPerSm in steps of 8 (168, 80, 128); the
  // consumers' setmaxnreg.inc can only take what the loader's setmaxnreg.dec gave back to the block's
  // pool (else it waits forever).
  static constexpr int kEntryRegs = 65536 / kThreads / kBlocksPerSm / 8 * 8;
  static constexpr int kLoaderRegs = 24, kConsumerRegs = kTile == 0 ? 240 : kTile == 1 ? 104 : 232;
  static_assert(kLoaderRegs * 128 + kConsumerRegs * 128 * kConsumers <= kEntryRegs * kThreads,
                "the registers the loader gives back");
  // +1024: the tiles start at the first 1024-byte boundary of the dynamic shared memory (the
  // 128-byte swizzle is computed from address bits 4-9).
  static constexpr int kSmemBytes = (BR * HD + STAGES * 2 * BC * HD) * int(sizeof(T)) + 1024;
  // An SM's 228 KB hold kBlocksPerSm blocks, each with 1 KB reserved by the runtime and 1 KB of static
  // shared memory (the barriers, padded by the 1024-byte alignment: ptxas).
  static_assert(kBlocksPerSm * (kSmemBytes + 2048) <= 228 * 1024, "kBlocksPerSm blocks per SM");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The block's (query tile, head, batch). The blocks go out in the order of their linear id, x + gridDim.x
// * (y + gridDim.y * z), and the launcher lays the grid out so that this id orders the tiles:
// (query tiles, nheads_q, batch) in the natural order (FlashBlock: tile x counted from the last, so each
// (head, batch) runs its tiles longest-first, one (head, batch) after the other); (nheads_q, batch, query
// tiles) longest-first (p.longest_first): id = h + nheads_q * (b + batch * z), tile z counted from the
// last: every (head, batch)'s last tile, then every one's second last, and so on. The grid's shape
// carries the order, not a division of the linear id: ptxas spilled the cp.async loader's 24 registers
// with the division's results (and with selects in place of this branch).
template <typename T>
__device__ __forceinline__ FlashBlock<T> flash_wgmma_block(const AttentionParams& p, int br, int bc) {
  if (!p.longest_first) return FlashBlock<T>(p, br, bc);
  return FlashBlock<T>(p, br, bc, (int(gridDim.z) - 1 - int(blockIdx.z)) * br, int(blockIdx.x), int(blockIdx.y));
}

// The loader warpgroup: Q with tile 0, then K_t and V_t into stage t % STAGES once every consumer
// warpgroup is done with the tile that was there. One copy group stays in flight: tile t is
// announced (wait, proxy fence, arrive on full) after tile t + 1 is issued.
template <typename T, int HD, int kTile>
__device__ __forceinline__ void flash_wgmma_load(const AttentionParams& p, const FlashBlock<T>& blk, T* sq,
                                                 T* stages, uint64_t* full, uint64_t* empty) {
  using C = FlashWgmmaConfig<T, HD, kTile>;
  constexpr int BR = C::BR, BC = C::BC, STAGES = C::STAGES;
  // Q's copies 2 per loop step at BR 64: its 4 per thread all at once spill at 24 registers (ptxas).
  constexpr int kQUnroll = BR == 64 ? 2 : 4;
  const auto q_offset = [](int r, int c) { return sw128_offset<BR>(r, c); };
  const auto kv_offset = [](int r, int c) { return sw128_offset<BC>(r, c); };
  for (int t = 0; t < blk.n_tiles; ++t) {
    const int st = t % STAGES;
    mbarrier_wait(&empty[st], ((t / STAGES) & 1) ^ 1);
    if (t == 0) {
      flash_load_rows<BR, HD, 128, kQUnroll>(sq, q_offset, blk.q, p.q_stride_s, blk.i0, p.seqlen_q, p.headdim);
    }
    T* const ks = stages + st * 2 * BC * HD;
    flash_load_rows<BC, HD, 128, 4>(ks, kv_offset, blk.k, p.k_stride_s, t * BC, p.seqlen_k, p.headdim);
    flash_load_rows<BC, HD, 128, 4>(ks + BC * HD, kv_offset, blk.v, p.v_stride_s, t * BC, p.seqlen_k, p.headdim);
    cp_async_commit();
    if (t > 0) {
      cp_async_wait<1>();
      fence_proxy_async_shared();  // the copies, visible to the tensor cores
      mbarrier_arrive(&full[(t - 1) % STAGES]);
    }
  }
  if (blk.n_tiles > 0) {
    cp_async_wait<0>();
    fence_proxy_async_shared();
    mbarrier_arrive(&full[(blk.n_tiles - 1) % STAGES]);
  }
}

// The TMA loader (one thread): per tile, once every consumer handed its stage back, the stage's full
// barrier is told the bytes to expect (with tile 0 also Q's, on the same barrier, as the cp.async
// loader does), then the copies are issued; the barrier's phase completes when they have landed.
template <typename T, int HD, int kTile>
__device__ __forceinline__ void flash_wgmma_load_tma(const FlashTmaMaps& maps, const FlashBlock<T>& blk, int hkv,
                                                     T* sq, T* stages, uint64_t* full, uint64_t* empty) {
  using C = FlashWgmmaConfig<T, HD, kTile>;
  constexpr int BR = C::BR, BC = C::BC, STAGES = C::STAGES, PANELS = HD / 64;
  constexpr uint32_t kTileBytes = BC * HD * sizeof(T), kQBytes = BR * HD * sizeof(T);
  for (int t = 0; t < blk.n_tiles; ++t) {
    const int st = t % STAGES;
    mbarrier_wait(&empty[st], ((t / STAGES) & 1) ^ 1);
    mbarrier_arrive_expect_tx(&full[st], 2 * kTileBytes + (t == 0 ? kQBytes : 0));
    if (t == 0) {
#pragma unroll
      for (int pn = 0; pn < PANELS; ++pn) tma_load_4d(sq + pn * BR * 64, &maps.q, 64 * pn, blk.i0, blk.h, blk.b, &full[0]);
    }
    T* const ks = stages + st * 2 * BC * HD;
#pragma unroll
    for (int pn = 0; pn < PANELS; ++pn) {
      tma_load_4d(ks + pn * BC * 64, &maps.k, 64 * pn, t * BC, hkv, blk.b, &full[st]);
      tma_load_4d(ks + BC * HD + pn * BC * 64, &maps.v, 64 * pn, t * BC, hkv, blk.b, &full[st]);
    }
  }
}

// A consumer warpgroup (wg 0 .. kConsumers - 1): 64 query rows through every key tile, then the output.
template <typename T, int HD, int kTile, bool kMask>
__device__ __forceinline__ void flash_wgmma_consume(const AttentionParams& p, const FlashBlock<T>& blk, int wg,
                                                    const T* sq, const T* stages, uint64_t* full, uint64_t* empty) {
  using C = FlashWgmmaConfig<T, HD, kTile>;
  constexpr int BR = C::BR, BC = C::BC, STAGES = C::STAGES;
  const int h = blk.h, b = blk.b, n_tiles = blk.n_tiles;
  const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int diag = p.seqlen_k - p.seqlen_q;  // key j is visible to query i iff j <= i + diag (causal)
  const int row_wg = blk.i0 + wg * 64;   // this warpgroup's first query row
  const int row_w = row_wg + warp * 16;  // this warp's
  // Under causal, the key tiles from wg_end on are hidden from every row of this warpgroup.
  const int wg_end = p.causal ? min(p.seqlen_k, min(row_wg + 64, p.seqlen_q) + diag) : p.seqlen_k;

  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};  // rows g and g + 8; l summed per lane
  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float s[BC / 8][4];
  // wgmma takes the accumulators as one flat array: m16n8 fragment n is elements 4n .. 4n + 3.
  float(&s_flat)[BC / 2] = reinterpret_cast<float(&)[BC / 2]>(s);
  float(&o_flat)[HD / 2] = reinterpret_cast<float(&)[HD / 2]>(o);
  uint32_t pa[BC / 16][4];  // P of the previous tile (A fragments), while its P·V is pending
  bool pending = false;
  const FlashMask<T> mask(p, b, h);
  // Q: this warpgroup's 64 rows; K-major, a K step of 16 is +32 bytes, a panel of 64 is BR rows.
  const uint32_t q_base = smem_addr(sq) + wg * 64 * 128;

  // O += P·V of tile t (issued, not waited for): P from registers, keys 16 kb .. +15 per step; V
  // MN-major: 16 key rows = 2048 bytes, the HD / 64 panels BC rows apart (the LBO).
  auto issue_pv = [&](int t) {
    const uint32_t v_base = smem_addr(stages + (t % STAGES) * 2 * BC * HD + BC * HD);
    wgmma_fence();
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb) {
      Wgmma<T, HD>::rs(o_flat, pa[kb], sw128_desc(v_base + kb * 16 * 128, BC * 128), 1);
    }
    wgmma_commit();
  };

  // Ping-pong (two consumers): they take turns issuing a tile's MMAs (named barrier 1 + wg is this
  // one's turn, given by the other after it issued), so one's softmax runs under the other's
  // MMAs. Consumer 0 starts; each gives the turn once per tile, except consumer 1 after its last
  // (nobody waits for it), skipped tiles included, so both pass the same number of turns. A lone
  // consumer (tile 2) has no partner: the other block on its SM plays that role.
  constexpr bool kPingPong = C::kConsumers == 2;
  constexpr int kPair = 256;
  const int my_turn = 1 + wg, other_turn = 2 - wg;
  auto take_turn = [&] {
    if constexpr (kPingPong) named_barrier_sync(my_turn, kPair);
  };
  auto pass_turn = [&](int t) {
    if constexpr (kPingPong) {
      if (wg == 0 || t + 1 < n_tiles) named_barrier_arrive(other_turn, kPair);
    }
  };
  if constexpr (kPingPong) {
    if (wg == 1 && n_tiles > 0) named_barrier_arrive(other_turn, kPair);
  }

  // Per tile t: S_t = Q·K_tᵀ, then P_{t-1}·V_{t-1} queued behind it on the tensor cores; the
  // softmax of S_t runs while that P·V does; O is rescaled once it is done, and stage t - 1 is
  // handed back to the loader.
  for (int t = 0; t < n_tiles; ++t) {
    // Even a tile this warpgroup skips is waited for before it is handed back: an early arrival
    // could complete a later phase of the stage's empty barrier.
    mbarrier_wait(&full[t % STAGES], (t / STAGES) & 1);
    take_turn();
    const int j0 = t * BC;
    if (j0 >= wg_end) {  // warpgroup-uniform: this tile and every later one are hidden from its rows
      if (pending) {
        issue_pv(t - 1);
        pass_turn(t);
        wgmma_wait<0>();
        wgmma_fence_operands(o_flat);
        mbarrier_arrive(&empty[(t - 1) % STAGES]);
        pending = false;
      } else {
        pass_turn(t);
      }
      mbarrier_arrive(&empty[t % STAGES]);
      continue;
    }
    const uint32_t k_base = smem_addr(stages + (t % STAGES) * 2 * BC * HD);

    // S = Q·Kᵀ: 64 rows x BC keys, HD / 16 steps of K = 16.
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t koff = (kk % 4) * 32;  // bytes inside the panel's 128-byte rows
      const uint64_t da = sw128_desc(q_base + (kk / 4) * (BR * 128) + koff, 16);
      const uint64_t db = sw128_desc(k_base + (kk / 4) * (BC * 128) + koff, 16);
      Wgmma<T, BC>::ss(s_flat, da, db, kk > 0);
    }
    wgmma_commit();
    if (pending) {
      issue_pv(t - 1);
      pass_turn(t);
      wgmma_wait<1>();  // S_t done; P_{t-1}·V_{t-1} may still run
    } else {
      pass_turn(t);
      wgmma_wait<0>();
    }
    wgmma_fence_operands(s_flat);

    const bool edge = j0 + BC > p.seqlen_k || (p.causal && j0 + BC - 1 > row_w + diag);
    flash_scale_mask<T, kMask>(s, p, mask, row_w + g, j0 + 2 * t4, edge);
    float corr[2];
    flash_online_softmax(s, m, l, corr);
    wgmma_wait<0>();  // P_{t-1}·V_{t-1} added: O and pa are free, and so is stage t - 1
    wgmma_fence_operands(o_flat);
    if (pending) mbarrier_arrive(&empty[(t - 1) % STAGES]);
    flash_rescale(o, corr);
#pragma unroll
    for (int kb = 0; kb < BC / 16; ++kb) flash_p_fragment<T>(pa[kb], s, kb);
    pending = true;
  }
  if (pending) {  // the last tile's P·V (its stage is not handed back: nothing is loaded after it)
    issue_pv(n_tiles - 1);
    wgmma_wait<0>();
    wgmma_fence_operands(o_flat);
  }

  flash_store<T>(p, o, m, l, b, h, row_w + g, t4);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, int HD, int kTile, bool kTma, bool kMask>
__global__ void __launch_bounds__(FlashWgmmaConfig<T, HD, kTile>::kThreads,
                                  FlashWgmmaConfig<T, HD, kTile>::kBlocksPerSm)
    attention_flash_wgmma_kernel(const AttentionParams p, const __grid_constant__ FlashTmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = FlashWgmmaConfig<T, HD, kTile>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // full[s]: stage s landed (the cp.async loader's 128 threads arrive; the TMA loader's one thread
  // arrives and the bytes complete it); empty[s]: every consumer warpgroup is done with it (their 128 x
  // kConsumers threads arrive).
  __shared__ uint64_t full[C::STAGES], empty[C::STAGES];
  const uint32_t raw = smem_addr(smem_raw);
  T* const sq = reinterpret_cast<T*>(smem_raw + (((raw + 1023) & ~1023u) - raw));  // [BR][HD], SW128 panels
  T* const stages = sq + C::BR * HD;  // [stage][K, V][BC][HD], SW128 panels: tile t in stage t % STAGES
  const FlashBlock<T> blk = flash_wgmma_block<T>(p, C::BR, C::BC);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < C::STAGES; ++st) {
      mbarrier_init(&full[st], kTma ? 1 : 128);
      mbarrier_init(&empty[st], 128 * C::kConsumers);
    }
  }
  __syncthreads();
  // The warpgroup index as a warp-uniform value (a shuffle from lane 0), so the compiler sees each
  // role as one warpgroup-uniform branch and budgets its registers by its setmaxnreg.
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  if (wg == 0) {
    setmaxnreg_dec<C::kLoaderRegs>();
    if constexpr (kTma) {
      if (threadIdx.x == 0) {
        flash_wgmma_load_tma<T, HD, kTile>(maps, blk, blk.h / p.group, sq, stages, full, empty);
      }
    } else {
      flash_wgmma_load<T, HD, kTile>(p, blk, sq, stages, full, empty);
    }
  } else {
    setmaxnreg_inc<C::kConsumerRegs>();
    flash_wgmma_consume<T, HD, kTile, kMask>(p, blk, wg - 1, sq, stages, full, empty);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built without sm_90a: the launcher never selects this kernel (attention_flash_wgmma_arch)
#endif
}

template <typename T, int HD, int kTile>
void launch_attention_flash_wgmma(const AttentionParams& p, cudaStream_t stream) {
  using C = FlashWgmmaConfig<T, HD, kTile>;
  FlashTmaMaps maps{};
  bool tma = false;
  if constexpr (kFlashTma) {
    const CUtensorMapDataType type =
        std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    tma = encode_bhsd_map(&maps.q, type, p.q, p.batch, p.nheads_q, p.seqlen_q, p.headdim, p.q_stride_b,
                          p.q_stride_h, p.q_stride_s, 64, C::BR) &&
          encode_bhsd_map(&maps.k, type, p.k, p.batch, p.nheads_kv, p.seqlen_k, p.headdim, p.k_stride_b,
                          p.k_stride_h, p.k_stride_s, 64, C::BC) &&
          encode_bhsd_map(&maps.v, type, p.v, p.batch, p.nheads_kv, p.seqlen_k, p.headdim, p.v_stride_b,
                          p.v_stride_h, p.v_stride_s, 64, C::BC);
  }
  // Built with and without the mask's per-score path: an unmasked launch's code has none of it.
  auto* kernel = p.mask != nullptr ? (tma ? attention_flash_wgmma_kernel<T, HD, kTile, true, true>
                                          : attention_flash_wgmma_kernel<T, HD, kTile, false, true>)
                                   : (tma ? attention_flash_wgmma_kernel<T, HD, kTile, true, false>
                                          : attention_flash_wgmma_kernel<T, HD, kTile, false, false>);
  allow_dynamic_smem(kernel, C::kSmemBytes);
  // The grid flash_wgmma_block reads: the query tiles in z longest-first (at most 65535 there: past
  // 65535 BR query rows the natural order), in x otherwise.
  const unsigned tiles = unsigned((p.seqlen_q + C::BR - 1) / C::BR);
  AttentionParams kp = p;
  kp.longest_first = p.longest_first && tiles <= 65535;
  const dim3 grid = kp.longest_first ? dim3(unsigned(p.nheads_q), unsigned(p.batch), tiles)
                                     : dim3(tiles, unsigned(p.nheads_q), unsigned(p.batch));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(kp, maps);
}

// 90 when the library was built for sm_90a only among the 9.x targets (FUSED_ATTN_SM90A, set by
// fused_attn/build.py) and the current device runs that build's kernel (one tile's: every tile is built
// in the same unit); else 0.
template <typename T, int HD>
int attention_flash_wgmma_arch() {
#if defined(FUSED_ATTN_SM90A)
  constexpr int kTile = HD == 64 ? 2 : 0;
  cudaFuncAttributes attr{};
  const bool ok =
      cudaFuncGetAttributes(&attr, attention_flash_wgmma_kernel<T, HD, kTile, false, false>) == cudaSuccess;
  return ok && attr.binaryVersion == 90 ? 90 : 0;
#else
  return 0;
#endif
}

}  // namespace fused_attn
