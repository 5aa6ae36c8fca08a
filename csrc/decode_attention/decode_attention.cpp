// Launcher of decode_attention (schema: fused_attn/_ops.py): the checks that guard memory, the
// split-KV choice and the kernel choice (decode_attention_heuristics.h), the cluster-or-combine choice
// (the partial-result workspace when it is the combine kernel), and dtype / head-dim / rows-per-block
// dispatch. Host C++ (g++): the kernels are launched through decode_attention_launch.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "../common/checks.h"
#include "../common/ops.h"
#include "../common/static_switch.h"
#include "decode_attention_heuristics.h"
#include "decode_attention_launch.h"

namespace fused_attn {

namespace {

constexpr int kMaxHeaddim = 256;
// A paged cache's page sizes: powers of two (the kernel splits a slot into page and row with a shift).
constexpr int64_t kMinPageSize = 16, kMaxPageSize = 256;

std::string strides_str(const at::Tensor& t) { return shape_str(t.strides()); }

// A page pool's page and row strides in bytes fit 32 bits (a pool of one page: its page stride is never used).
constexpr const char* kPageStridesFit =
    "have page (dim 0, when num_pages > 1) and row (dim 2) strides below 2**32 bytes with block_table";
bool page_strides_fit(const at::Tensor& pool) {
  const int64_t limit = int64_t(1) << 32;
  return (pool.size(0) <= 1 || pool.stride(0) * pool.element_size() < limit) &&
         pool.stride(2) * pool.element_size() < limit;
}
uint32_t page_stride_bytes(const at::Tensor& pool) {
  return pool.size(0) <= 1 ? 0 : uint32_t(pool.stride(0) * pool.element_size());
}

#define FA_CHECK_ROWS_ALIGNED(t)                                                                        \
  FA_CHECK_ARG(rows_aligned(t), t,                                                                      \
               "have a contiguous last dim and 16-byte aligned rows (other strides multiples of " +     \
                   std::to_string(16 / (t).element_size()) + ")",                                       \
               "strides " + strides_str(t))

#define FA_CHECK_LIKE_Q(t)       \
  FA_CHECK_CUDA(t);              \
  FA_CHECK_SAME_DEVICE(t, q);    \
  FA_CHECK_SAME_DTYPE(t, q);     \
  FA_CHECK_ROWS_ALIGNED(t)

#define FA_CHECK_LENGTHS(t)                                                                           \
  FA_CHECK_CUDA(t);                                                                                   \
  FA_CHECK_SAME_DEVICE(t, q);                                                                         \
  FA_CHECK_ARG((t).scalar_type() == at::kInt, t, "have dtype torch.int32", dtype_str((t).scalar_type())); \
  FA_CHECK_ARG((t).dim() == 1 && (t).size(0) == batch, t,                                             \
               "have shape (batch,) = (" + std::to_string(batch) + ",)", shape_str((t).sizes()));       \
  FA_CHECK_ARG((t).is_contiguous(), t, "be contiguous", "strides " + strides_str(t))

// The batch size: q's dim 0, or with cu_seqlens_q (q packed [total_q, nheads_q, headdim]) the cache's:
// block_table's rows for a paged cache, else k_cache's dim 0.
int64_t batch_of(const at::Tensor& q, const at::Tensor& k_cache, const std::optional<at::Tensor>& block_table,
                 bool ragged) {
  if (!ragged) return q.size(0);
  if (block_table.has_value()) return block_table->dim() > 0 ? block_table->size(0) : 0;
  return k_cache.size(0);
}

// The locals are named after the arguments: the check macros stringify them into the message.
double check_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const std::optional<at::Tensor>& cache_seqlens_opt, const std::optional<at::Tensor>& k_new_opt,
                  const std::optional<at::Tensor>& v_new_opt, const std::optional<at::Tensor>& cache_leftpad_opt,
                  const std::optional<at::Tensor>& key_mask_opt, std::optional<double> scale, int64_t num_splits,
                  const std::optional<at::Tensor>& block_table_opt,
                  const std::optional<at::Tensor>& cu_seqlens_q_opt, int64_t max_seqlen_q, const at::Tensor* out_ptr) {
  FA_CHECK_CUDA(q);
  FA_CHECK_ARG(q.scalar_type() == at::kFloat || q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
               q, "have dtype float32, float16 or bfloat16", dtype_str(q.scalar_type()));
  const bool ragged = cu_seqlens_q_opt.has_value();
  if (ragged) {
    FA_CHECK_DIM(q, 3, "[total_q, nheads_q, headdim]");
  } else {
    FA_CHECK_DIM(q, 4, "[batch, nheads_q, seqlen_new, headdim]");
  }
  // Ragged: new tokens (dim 0, the packed rows) and headdim (dim 2) of the 3-dim q.
  const int64_t q_headdim = q.size(q.dim() - 1), q_new = ragged ? max_seqlen_q : q.size(2);
  const bool paged = block_table_opt.has_value();
  if (paged) {
    FA_CHECK_DIM(k_cache, 4, "[num_pages, nheads_kv, page_size, headdim]");
    FA_CHECK_DIM(v_cache, 4, "[num_pages, nheads_kv, page_size, headdim]");
  } else {
    FA_CHECK_DIM(k_cache, 4, "[batch, nheads_kv, max_len, headdim]");
    FA_CHECK_DIM(v_cache, 4, "[batch, nheads_kv, max_len, headdim]");
  }
  FA_CHECK_LIKE_Q(q);
  FA_CHECK_LIKE_Q(k_cache);
  FA_CHECK_LIKE_Q(v_cache);
  FA_CHECK_ARG(v_cache.sizes() == k_cache.sizes(), v_cache, "have k_cache's shape " + shape_str(k_cache.sizes()),
               shape_str(v_cache.sizes()));
  const int64_t batch = batch_of(q, k_cache, block_table_opt, ragged);
  int64_t max_len = k_cache.size(2);
  if (paged) {
    const at::Tensor& block_table = *block_table_opt;
    FA_CHECK_CUDA(block_table);
    FA_CHECK_SAME_DEVICE(block_table, q);
    FA_CHECK_ARG(block_table.scalar_type() == at::kInt, block_table, "have dtype torch.int32",
                 dtype_str(block_table.scalar_type()));
    FA_CHECK_ARG(block_table.dim() == 2 && block_table.size(0) == batch, block_table,
                 "have shape (batch, max_blocks) = (" + std::to_string(batch) + ", max_blocks)",
                 shape_str(block_table.sizes()));
    FA_CHECK_ARG(block_table.size(1) <= 1 || block_table.stride(1) == 1, block_table,
                 "have a contiguous last dim (stride 1)", "strides " + strides_str(block_table));
    const int64_t page_size = k_cache.size(2);
    FA_CHECK_ARG(page_size >= kMinPageSize && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0,
                 k_cache, "have a page_size (dim 2) that is a power of two in [16, 256] with block_table",
                 shape_str(k_cache.sizes()));
    FA_CHECK_ARG(block_table.size(1) * page_size < std::numeric_limits<int>::max() &&
                     k_cache.size(0) < std::numeric_limits<int>::max(),
                 block_table, "have max_blocks x page_size below 2**31",
                 std::to_string(block_table.size(1)) + " x " + std::to_string(page_size));
    // decode::TileRows addresses a row with 32 x 32 -> 64-bit multiply-adds of the page and row strides in bytes.
    FA_CHECK_ARG(page_strides_fit(k_cache), k_cache, kPageStridesFit, "strides " + strides_str(k_cache));
    FA_CHECK_ARG(page_strides_fit(v_cache), v_cache, kPageStridesFit, "strides " + strides_str(v_cache));
    max_len = block_table.size(1) * page_size;
  } else {
    FA_CHECK_ARG(k_cache.size(0) == batch, k_cache, "have q's batch size (" + std::to_string(batch) + ")",
                 shape_str(k_cache.sizes()));
  }
  FA_CHECK_ARG(k_cache.size(3) == q_headdim, k_cache, "have q's headdim (" + std::to_string(q_headdim) + ")",
               shape_str(k_cache.sizes()));
  const int64_t nheads_kv = k_cache.size(1);
  FA_CHECK_ARG(nheads_kv > 0 && q.size(1) % nheads_kv == 0, q,
               "have nheads_q a multiple of k_cache's nheads_kv (" + std::to_string(nheads_kv) + ")",
               std::to_string(q.size(1)));
  const int64_t headdim = q_headdim;
  FA_CHECK_ARG(headdim % 8 == 0 && headdim >= 8 && headdim <= kMaxHeaddim, q,
               "have a headdim that is a multiple of 8 in [8, 256] on CUDA", std::to_string(headdim));
  if (ragged) {
    FA_CHECK_ARG(max_seqlen_q >= 0 && max_seqlen_q < (1 << 20), max_seqlen_q,
                 "be an int in [0, 2**20) with cu_seqlens_q", num_str(max_seqlen_q));
  } else {
    FA_CHECK_ARG(max_seqlen_q == 0, max_seqlen_q, "be 0 (unused) without cu_seqlens_q", num_str(max_seqlen_q));
  }
  FA_CHECK_ARG(max_len < std::numeric_limits<int>::max() && q_new < (1 << 20) &&
                   q.numel() < std::numeric_limits<int>::max(),
               q, "have fewer than 2**20 new tokens, 2**31 elements and max_len below 2**31",
               shape_str(q.sizes()));
  FA_CHECK_ARG(k_new_opt.has_value() == v_new_opt.has_value(), k_new, "be given together with v_new",
               k_new_opt.has_value() ? "k_new without v_new" : "v_new without k_new");
  if (k_new_opt.has_value()) {
    const std::vector<int64_t> want = ragged ? std::vector<int64_t>{q.size(0), nheads_kv, headdim}
                                             : std::vector<int64_t>{q.size(0), nheads_kv, q.size(2), headdim};
    const std::string want_str = std::string(ragged ? "have shape (total_q, nheads_kv, headdim) = "
                                                    : "have shape (batch, nheads_kv, seqlen_new, headdim) = ") +
                                 shape_str(want);
    const at::Tensor& k_new = *k_new_opt;
    const at::Tensor& v_new = *v_new_opt;
    if (ragged) {
      FA_CHECK_DIM(k_new, 3, "[total_q, nheads_kv, headdim]");
      FA_CHECK_DIM(v_new, 3, "[total_q, nheads_kv, headdim]");
    } else {
      FA_CHECK_DIM(k_new, 4, "[batch, nheads_kv, seqlen_new, headdim]");
      FA_CHECK_DIM(v_new, 4, "[batch, nheads_kv, seqlen_new, headdim]");
    }
    FA_CHECK_LIKE_Q(k_new);
    FA_CHECK_LIKE_Q(v_new);
    FA_CHECK_ARG(k_new.sizes() == at::IntArrayRef(want), k_new, want_str, shape_str(k_new.sizes()));
    FA_CHECK_ARG(v_new.sizes() == at::IntArrayRef(want), v_new, want_str, shape_str(v_new.sizes()));
  }
  FA_CHECK_ARG(cache_seqlens_opt.has_value() || !k_new_opt.has_value(), cache_seqlens,
               "be given when appending (k_new)", "None");
  if (cache_seqlens_opt.has_value()) {
    const at::Tensor& cache_seqlens = *cache_seqlens_opt;
    FA_CHECK_LENGTHS(cache_seqlens);
  }
  if (key_mask_opt.has_value()) {
    const at::Tensor& key_mask = *key_mask_opt;
    FA_CHECK_CUDA(key_mask);
    FA_CHECK_SAME_DEVICE(key_mask, q);
    FA_CHECK_ARG(key_mask.scalar_type() == at::kBool, key_mask, "have dtype torch.bool (True = attend)",
                 dtype_str(key_mask.scalar_type()));
    FA_CHECK_ARG(key_mask.dim() == 2 && (key_mask.size(0) == 1 || key_mask.size(0) == batch) &&
                     key_mask.size(1) == max_len,
                 key_mask,
                 "have shape (batch or 1, max_len) = (" + std::to_string(batch) + " or 1, " +
                     std::to_string(max_len) + ")",
                 shape_str(key_mask.sizes()));
    FA_CHECK_ARG(key_mask.size(1) <= 1 || key_mask.stride(1) == 1, key_mask, "have a contiguous last dim (stride 1)",
                 "strides " + strides_str(key_mask));
  }
  if (cache_leftpad_opt.has_value()) {
    const at::Tensor& cache_leftpad = *cache_leftpad_opt;
    FA_CHECK_LENGTHS(cache_leftpad);
  }
  if (ragged) {
    const at::Tensor& cu_seqlens_q = *cu_seqlens_q_opt;
    FA_CHECK_CUDA(cu_seqlens_q);
    FA_CHECK_SAME_DEVICE(cu_seqlens_q, q);
    FA_CHECK_ARG(cu_seqlens_q.scalar_type() == at::kInt, cu_seqlens_q, "have dtype torch.int32",
                 dtype_str(cu_seqlens_q.scalar_type()));
    FA_CHECK_ARG(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == batch + 1, cu_seqlens_q,
                 "have shape (batch + 1,) = (" + std::to_string(batch + 1) + ",)", shape_str(cu_seqlens_q.sizes()));
    FA_CHECK_ARG(cu_seqlens_q.is_contiguous(), cu_seqlens_q, "be contiguous", "strides " + strides_str(cu_seqlens_q));
  }
  FA_CHECK_ARG(num_splits >= 0 && num_splits <= kMaxSplits, num_splits, "be an int in [0, 256]",
               num_str(num_splits));
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(double(headdim));
  FA_CHECK_ARG(std::isfinite(s), scale, "be a finite number", num_str(s));
  if (out_ptr != nullptr) {
    const at::Tensor& out = *out_ptr;
    FA_CHECK_LIKE_Q(out);
    FA_CHECK_ARG(out.sizes() == q.sizes(), out, "have q's shape " + shape_str(q.sizes()), shape_str(out.sizes()));
  }
  return s;
}

int sm_count(const at::Tensor& t) {
  return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount;
}

template <typename T, int HD>
bool cluster_capable(int R) {
  switch (R) {
    case 1: return decode_cluster_capable<T, HD, 1>();
    case 2: return decode_cluster_capable<T, HD, 2>();
    case 4: return decode_cluster_capable<T, HD, 4>();
    default: return decode_cluster_capable<T, HD, 8>();
  }
}

void launch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
            const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cache_leftpad,
            const std::optional<at::Tensor>& key_mask, double scale, int64_t num_splits,
            const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& cu_seqlens_q,
            int64_t max_seqlen_q, const at::Tensor& out) {
  const bool ragged = cu_seqlens_q.has_value();
  // Ragged with max_seqlen_q 0: no sequence may have a new token (the kernel would give one none).
  if (out.numel() == 0 || (ragged && max_seqlen_q == 0)) return;
  const c10::cuda::CUDAGuard guard(q.device());
  DecodeParams p{};
  // Packed rows (ragged): row cu[b] + i of sequence b's token i, the kernel adds cu[b] x stride_s; no
  // batch stride.
  auto strides = [&](const at::Tensor& t, int64_t& b, int64_t& h, int64_t& s) {
    b = ragged ? 0 : t.stride(0), h = t.stride(1), s = ragged ? t.stride(0) : t.stride(2);
  };
  p.q = q.data_ptr();
  strides(q, p.q_stride_b, p.q_stride_h, p.q_stride_s);
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.k_stride_b = k_cache.stride(0), p.k_stride_h = k_cache.stride(1), p.k_stride_l = k_cache.stride(2);
  p.v_stride_b = v_cache.stride(0), p.v_stride_h = v_cache.stride(1), p.v_stride_l = v_cache.stride(2);
  if (k_new.has_value()) {
    p.k_new = k_new->data_ptr();
    p.v_new = v_new->data_ptr();
    strides(*k_new, p.kn_stride_b, p.kn_stride_h, p.kn_stride_s);
    strides(*v_new, p.vn_stride_b, p.vn_stride_h, p.vn_stride_s);
  }
  p.out = out.data_ptr();
  strides(out, p.o_stride_b, p.o_stride_h, p.o_stride_s);
  p.seqlens = cache_seqlens.has_value() ? cache_seqlens->data_ptr<int>() : nullptr;
  p.leftpad = cache_leftpad.has_value() ? cache_leftpad->data_ptr<int>() : nullptr;
  p.key_mask = key_mask.has_value() ? key_mask->data_ptr<bool>() : nullptr;
  p.key_mask_stride_b = key_mask.has_value() && key_mask->size(0) > 1 ? key_mask->stride(0) : 0;
  p.cu_seqlens_q = ragged ? cu_seqlens_q->data_ptr<int>() : nullptr;
  p.total_q = ragged ? int(q.size(0)) : 0;
  p.batch = int(batch_of(q, k_cache, block_table, ragged));
  p.nheads_q = int(q.size(1));
  p.nheads_kv = int(k_cache.size(1));
  p.seqlen_new = int(ragged ? max_seqlen_q : q.size(2));
  p.headdim = int(q.size(q.dim() - 1));
  p.max_len = int(k_cache.size(2));
  if (block_table.has_value()) {
    p.block_table = block_table->data_ptr<int>();
    p.table_stride_b = block_table->stride(0);
    p.page_shift = 0;
    while ((int64_t(1) << p.page_shift) < k_cache.size(2)) ++p.page_shift;
    p.num_pages = int(k_cache.size(0));
    p.k_page_bytes = page_stride_bytes(k_cache);
    p.k_row_bytes = uint32_t(k_cache.stride(2) * k_cache.element_size());
    p.v_page_bytes = page_stride_bytes(v_cache);
    p.v_row_bytes = uint32_t(v_cache.stride(2) * v_cache.element_size());
    p.page_mask = uint32_t(k_cache.size(2) - 1);
    p.max_len = int(block_table->size(1) * k_cache.size(2));
  }
  p.group = p.nheads_q / p.nheads_kv;
  p.rows = p.group * p.seqlen_new;
  const int R = decode_rows_per_block(p.rows);
  p.scale_log2 = float(scale * 1.4426950408889634);

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  FA_DISPATCH_FLOAT(q.scalar_type(), q, [&] {
    FA_DECODE_HEADDIM_SWITCH(p.headdim, HD, [&] {
      constexpr bool kMmaKernel = !std::is_same_v<scalar_t, float> && (HD == 64 || HD == 128);
      int mma_arch = 0;
      if constexpr (kMmaKernel) mma_arch = decode_use_mma(p.rows) ? decode_mma_arch<scalar_t, HD>() : 0;
      const bool use_mma = mma_arch >= 80;
      p.row_chunks = (p.rows + (use_mma ? 16 : R) - 1) / (use_mma ? 16 : R);
      const int64_t work = int64_t(p.batch) * p.nheads_kv * p.row_chunks;
      const bool paged = p.block_table != nullptr;
      FA_CHECK_ARG(work < std::numeric_limits<int>::max(), q,
                   "have batch x nheads_q x seqlen_new (max_seqlen_q) below 2**31 blocks", shape_str(q.sizes()));
      const bool cluster_ok = at::cuda::getDeviceProperties(q.device().index())->major >= 9 &&
                              (use_mma ? mma_arch >= 90 : cluster_capable<scalar_t, HD>(R));
      int blocks_per_sm = kDecodeBlocksPerSm, cluster_max_len = 0;
      if constexpr (kMmaKernel) {
        if (use_mma && num_splits <= 0) {
          const int fit = paged ? decode_mma_max_blocks_per_sm<scalar_t, HD, true>()
                                : decode_mma_max_blocks_per_sm<scalar_t, HD, false>();
          blocks_per_sm = decode_mma_blocks_per_sm(fit);
          cluster_max_len = kDecodeMmaClusterMaxLen;
        }
      }
      const int sms = sm_count(q);
      const int long_splits = use_mma ? 0 : decode_long_splits(work, p.max_len, sms, cluster_ok, paged);
      p.num_splits = num_splits > 0  ? int(num_splits)
                     : long_splits > 0 ? long_splits
                                       : decode_splits(work, p.max_len, sms, cluster_ok, blocks_per_sm,
                                                       cluster_max_len);
      p.cluster = cluster_ok && p.num_splits > 1 && p.num_splits <= kMaxClusterSplits;
      if constexpr (kMmaKernel) {
        if (use_mma && p.cluster) {
          const int fit = paged ? decode_mma_max_active_clusters<scalar_t, HD, true>(p.num_splits)
                                : decode_mma_max_active_clusters<scalar_t, HD, false>(p.num_splits);
          p.cluster = decode_cluster_fits(work, fit);
        }
      }
      p.programmatic = cluster_ok;  // the same condition: an sm_90 device, the kernel compiled for it
      decode_divisors(p, use_mma ? 16 : R);
      at::Tensor partial_o, partial_lse;
      if (p.num_splits > 1 && !p.cluster) {
        const int64_t rows = int64_t(p.num_splits) * p.batch * p.nheads_q * p.seqlen_new;
        partial_o = at::empty({rows * p.headdim}, q.options().dtype(at::kFloat));
        partial_lse = at::empty({rows}, q.options().dtype(at::kFloat));
        p.partial_o = partial_o.data_ptr<float>();
        p.partial_lse = partial_lse.data_ptr<float>();
      }
      FA_BOOL_SWITCH(paged, kPaged, [&] {
        if (use_mma) {
          if constexpr (kMmaKernel) launch_decode_mma<scalar_t, HD, kPaged>(p, stream);
        } else {
          switch (R) {
            case 1: launch_decode<scalar_t, HD, 1, kPaged>(p, stream); break;
            case 2: launch_decode<scalar_t, HD, 2, kPaged>(p, stream); break;
            case 4: launch_decode<scalar_t, HD, 4, kPaged>(p, stream); break;
            default: launch_decode<scalar_t, HD, 8, kPaged>(p, stream); break;
          }
        }
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (p.num_splits > 1 && !p.cluster) {
        launch_decode_combine<scalar_t>(p, decode_combine_arch<scalar_t>() >= 90, stream);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
}

}  // namespace

// Argument order follows the schemas in fused_attn/_ops.py.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
                            const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cache_leftpad,
                            const std::optional<at::Tensor>& key_mask, std::optional<double> scale,
                            int64_t num_splits, const std::optional<at::Tensor>& block_table,
                            const std::optional<at::Tensor>& cu_seqlens_q, int64_t max_seqlen_q) {
  const double s = check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
                              num_splits, block_table, cu_seqlens_q, max_seqlen_q, nullptr);
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  launch(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, s, num_splits, block_table,
         cu_seqlens_q, max_seqlen_q, out);
  return out;
}

void decode_attention_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& k_new,
                          const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cache_leftpad,
                          const std::optional<at::Tensor>& key_mask, std::optional<double> scale, int64_t num_splits,
                          const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& cu_seqlens_q,
                          int64_t max_seqlen_q, const at::Tensor& out) {
  const double s = check_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, scale,
                              num_splits, block_table, cu_seqlens_q, max_seqlen_q, &out);
  launch(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, key_mask, s, num_splits, block_table,
         cu_seqlens_q, max_seqlen_q, out);
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_out", &decode_attention_out);
}

}  // namespace fused_attn
