// What the single-launch MLP's launcher (mlp.cpp, host C++ with ATen) and its kernel (mlp_kernel.cuh,
// built in the generated mlp_inst_*.cu units) share. Torch-free and host-compilable.
#pragma once

#include <cuda_runtime_api.h>

#include "../linear/linear_launch.h"

namespace fused_attn {

// The two projections as linear's parameters: fc reads x and writes the hidden activations h (its
// bias and activation: GELU tanh, or SwiGLU with gate rows over up rows), proj reads h and writes out
// (its bias and the residual). The counters are the op's int32 workspace (zeros before a launch; each
// launch leaves them zero): arrived counts the blocks whose first-projection tiles are stored, left the
// blocks past their wait for them.
struct MlpParams {
  LinearParams fc;
  LinearParams proj;
  unsigned* arrived;
  unsigned* left;
};

// The workspace's int32 elements the kernel uses (arrived, then left).
constexpr int kMlpWorkspaceWords = 2;

// Defined in mlp_kernel.cuh, instantiated in mlp_inst_*.cu (generate_instantiations.py). T: __half or
// __nv_bfloat16; MT: 8 or 16 rows of x (one or two n-tiles of mma.sync). The grid is (16-row tiles of
// proj's weight) x splits, a cluster of `splits` blocks along K per tile; every block of it must be
// resident at once (the launcher asks mlp_max_clusters first). mlp_max_clusters: how many clusters of
// `splits` blocks fit the device at once (0 where the kernel was not compiled for sm_90).
constexpr int kMlpThreads = 256;
template <typename T, int MT>
cudaError_t launch_mlp(const MlpParams& p, int splits, cudaStream_t stream);
template <typename T, int MT>
int mlp_max_clusters(int splits);

}  // namespace fused_attn
