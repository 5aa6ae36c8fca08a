// Programmatic dependent launch (Hopper, sm_90) for the kernels of a decode step (torch-free).
//
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while the
// kernel before it on the stream is still running: from the moment every block of that one has
// executed launch_dependents() (or exited). Until it calls wait_for_primary() it must neither read
// what earlier kernels wrote nor write anything; what it may do is fetch its own constants (a
// GEMV's weights, a norm's weight and bias), which is the overlap PDL buys. wait_for_primary()
// returns once the earlier kernels have completed and their writes are visible. Both are no-ops in a
// launch without the attribute, and below sm_90 (where the attribute is not set).
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

namespace fused_attn {

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_primary() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A value an earlier kernel of the chain may have written (a length), read after wait_for_primary(): a
// relaxed GPU-scope load, which goes to L2, never to an L1 line that a read before the wait left (L1 is not
// coherent). decode_attention and qkv_decode_attention read their lengths so.
__device__ __forceinline__ int load_after_wait(const int* ptr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
#else
  return *static_cast<const volatile int*>(ptr);
#endif
}

// Where the decode chain's kernels (linear, layer_norm, decode_attention, sample) let their dependent
// launch. Each launch decides (its params' pdl_early, from pdl_early() below): early, every block
// triggers first thing, before it waits: the next kernel's blocks are scheduled as soon as all of this
// one's have started and SM resources allow, and fetch their weights while this kernel still waits for
// its own primary, so a chain of GEMVs streams its weights a kernel or two ahead of the dependent
// arithmetic; decode_attention also prefetches its cached K/V rows into L2 before its wait. Late (the
// trigger after the wait), kernel N + 1 fetches only during N's tail. Early stays correct because every
// block of these kernels executes wait_for_primary() before it exits: a grid completes only after its
// primary has, so a dependent's wait (which is for this grid's completion) covers every earlier kernel.
// A second launch_dependents() (the late one, always there) changes nothing.
__device__ __forceinline__ void launch_dependents_early(bool early) {
  if (early) launch_dependents();
}

// The trigger points, in rows (a GEMV's M, a norm's rows, decode attention's and the sampler's batch): the
// tuning table of every PDL-chained op (bench/ab.py's pdl-* variants move them on a copy of the tree).
//
// kPdlEarlyRows: launches of at most this many rows trigger early, larger ones late. GPT-2's captured
// fp16 step (bench.time_decode_graph), early against late, H100: -7% at batch 1, -2% at 2, -6% at 4, -7%
// at 8 (the fused QKV + attention launch serves 5-8 rows there; 272 -> 253 us), +3% at 16, where the
// blocks that run ahead (several kernels deep: each triggers its own dependent at once) hold SM slots and
// DRAM queues that the running kernel needs (decode attention's 192 blocks during c_attn's weight stream;
// keeping single kinds late at 16 rows measured no better).
// One exception by what follows: a linear with an activation epilogue (an MLP's first projection, whose
// consumer is a GEMV) triggers early at any row count (linear_kernel.cuh, with_linear_pdl_early).
constexpr long kPdlEarlyRows = 8;
// kPdlEarlyNormRows: the same limit for the norms alone (layer_norm / rms_norm, with or without the
// residual add, and the embedding's gathered-row norm). In a process that has joined a few streams or
// captured a few graphs (any real one), every programmatic launch reaches the SMs ~0.35 us after its
// primary's trigger, and the 16-row GEMVs after the norms (GPT-2's c_attn, c_fc), launched at the norm's
// late trigger, had ~0.2 us of head start left to fetch their weights in. A norm that triggers early lets
// them stream their weights under it, one kernel deep (the GEMVs still trigger late at 16 rows, so decode
// attention and the projections do not run ahead as they did with every launch early, +7 us). GPT-2's
// fp16 B16 step, H200, bench.time_decode_graph: 302.3 -> 276.6 us (-8.5%).
constexpr long kPdlEarlyNormRows = 16;

constexpr long pdl_early_rows() { return kPdlEarlyRows; }
constexpr bool pdl_early(long rows) { return rows <= kPdlEarlyRows; }
constexpr long pdl_early_norm_rows() { return kPdlEarlyNormRows; }

// A kernel's params (any struct with a pdl_early field) with the flag set for a launch of `rows` rows.
template <typename Params>
Params with_pdl_early(Params p, long rows) {
  p.pdl_early = pdl_early(rows);
  return p;
}

// FUSED_ATTN_PDL=0 in the environment (read once per process) launches every kernel without the attribute
// (each waits for the previous one to complete, as any launch): the kill switch, for telling a PDL race
// from other causes of a wrong result.
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("FUSED_ATTN_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return on;
}

// Launch `kernel` with the programmatic-serialization attribute where `programmatic` (the kernel
// compiled for sm_90 or later: its wait_for_primary() is real), and its blocks grouped in thread-block
// clusters of `cluster` blocks where that is more than one (sm_90; sizes above 8 need the kernel's
// cudaFuncAttributeNonPortableClusterSizeAllowed).
template <typename... Args>
cudaError_t launch_clustered(bool programmatic, dim3 cluster, void (*kernel)(Args...), dim3 grid, dim3 block,
                             size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  if (programmatic && pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// launch_clustered without clusters.
template <typename... Args>
cudaError_t launch_programmatic(bool programmatic, void (*kernel)(Args...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args... args) {
  return launch_clustered(programmatic, dim3(1, 1, 1), kernel, grid, block, smem, stream, args...);
}

// Whether `kernel` was compiled for sm_90 or later (its griddepcontrol instructions are there).
template <typename... Args>
bool programmatic_capable(void (*kernel)(Args...)) {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, kernel) == cudaSuccess && attr.binaryVersion >= 90;
}

}  // namespace fused_attn
