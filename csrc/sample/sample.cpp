// Launcher of sample and sample_out (schemas: fused_attn/_ops.py): the checks that guard memory, the
// [rows, vocab] view of the logits, and the split of a row over a cluster's blocks. Host C++ (g++): the
// kernel is launched through sample_launch.h. top_k is applied inside the kernel (a radix select over the
// row; fused_attn/sample.py's top_k_filter is the CPU path's definition of it).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "../common/checks.h"
#include "../common/ops.h"
#include "../common/static_switch.h"
#include "sample_heuristics.h"
#include "sample_launch.h"

namespace fused_attn {

namespace {

// The locals are named after the arguments: the check macros stringify them into the message.
void check_args(const at::Tensor& logits, double temperature, int64_t seed, int64_t offset,
                const std::optional<at::Tensor>& offsets_opt, int64_t top_k) {
  FA_CHECK_CUDA(logits);
  FA_CHECK_ARG(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kHalf ||
                   logits.scalar_type() == at::kBFloat16,
               logits, "have dtype float32, float16 or bfloat16", dtype_str(logits.scalar_type()));
  FA_CHECK_ARG(logits.dim() >= 1 && logits.size(-1) >= 1, logits, "have at least 1 dim [..., vocab], vocab >= 1",
               shape_str(logits.sizes()));
  FA_CHECK_ARG(logits.size(-1) < (int64_t(1) << 31), logits, "have a vocab (last dim) below 2**31",
               shape_str(logits.sizes()));
  FA_CHECK_ARG(logits.numel() / logits.size(-1) <= 65535, logits,
               "have at most 65535 rows (product of all dims but the last)", shape_str(logits.sizes()));
  FA_CHECK_ARG(std::isfinite(temperature) && temperature >= 0, temperature, "be a finite number >= 0",
               num_str(temperature));
  FA_CHECK_ARG(seed >= 0, seed, "be >= 0", num_str(seed));
  FA_CHECK_ARG(offset >= 0, offset, "be >= 0", num_str(offset));
  FA_CHECK_ARG(top_k >= 0 && top_k < (int64_t(1) << 31), top_k, "be an int in [0, 2147483648)", num_str(top_k));
  if (offsets_opt.has_value()) {
    const at::Tensor& offsets = *offsets_opt;
    FA_CHECK_SAME_DEVICE(offsets, logits);
    FA_CHECK_ARG(offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong, offsets,
                 "have dtype int32 or int64", dtype_str(offsets.scalar_type()));
    const int64_t rows = logits.numel() / logits.size(-1);
    FA_CHECK_ARG(offsets.numel() == 1 || offsets.numel() == rows, offsets,
                 "have 1 element or one per row (" + std::to_string(rows) + ")", shape_str(offsets.sizes()));
  }
}

// Whether a and b may share memory: the same storage and ranges that meet, or a layout too hard to tell.
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() > 0 && b.numel() > 0 && a.storage().is_alias_of(b.storage()) &&
         at::get_overlap_status(a, b) != at::MemOverlapStatus::No;
}

// Whether t (rows elements) is exactly one of advance's rows: each row then reads its own counter from it,
// before it advances it (fused_attn/sample.py: _own_row).
bool own_row(const at::Tensor& t, const at::Tensor& advance, int64_t rows) {
  const at::Tensor t1 = t.reshape({-1});
  if (t1.numel() != rows || t1.scalar_type() != advance.scalar_type() || t1.stride(0) != advance.stride(1)) {
    return false;
  }
  for (int64_t i = 0; i < advance.size(0); ++i) {
    if (t1.data_ptr() == advance[i].data_ptr()) return true;
  }
  return false;
}

// sample_out's advance: int32 / int64 [k, rows], one counter per element; neither out nor an offset that
// every row reads may be one of its counters (a row would advance it while another row still reads it).
void check_advance(const at::Tensor& logits, const std::optional<at::Tensor>& offsets, const at::Tensor& out,
                   const at::Tensor& advance) {
  FA_CHECK_SAME_DEVICE(advance, logits);
  FA_CHECK_ARG(advance.scalar_type() == at::kInt || advance.scalar_type() == at::kLong, advance,
               "have dtype int32 or int64", dtype_str(advance.scalar_type()));
  const int64_t rows = logits.numel() / logits.size(-1);
  FA_CHECK_ARG(advance.dim() == 2 && advance.size(1) == rows, advance,
               "have shape (k, rows) with rows = " + std::to_string(rows), shape_str(advance.sizes()));
  FA_CHECK_ARG(advance.numel() <= 1 || at::has_internal_overlap(advance) == at::MemOverlap::No, advance,
               "have no two elements in the same memory (one counter each: a dense layout)",
               "strides " + shape_str(advance.strides()));
  FA_CHECK_ARG(!may_overlap(out, advance), out, "not overlap advance",
               "overlapping memory");
  // Row r reads offsets[r] before it advances column r, and no other column: an offset may be one of row
  // r's own counters (one row of advance read as the offsets), never another row's.
  if (offsets.has_value() && rows > 1 && may_overlap(*offsets, advance)) {
    FA_CHECK_ARG(own_row(*offsets, advance, rows), offsets,
                 "be one of advance's rows or not overlap it (every row must read its own offset before it "
                 "advances its own counters)",
                 "an overlap of another shape");
  }
}

// sample_out's history [rows, L] and history_index [rows] (both given): row r writes history[r,
// history_index[r]] and nothing else of it, so history may share memory with no other tensor; the index is
// read by the thread that then writes out[r] and advances row r's counters: it may be row r's own counter.
void check_history(const at::Tensor& logits, const std::optional<at::Tensor>& offsets, const at::Tensor& out,
                   const std::optional<at::Tensor>& advance, const at::Tensor& history,
                   const at::Tensor& history_index) {
  FA_CHECK_SAME_DEVICE(history, logits);
  FA_CHECK_ARG(history.scalar_type() == at::kLong, history, "have dtype int64", dtype_str(history.scalar_type()));
  const int64_t rows = logits.numel() / logits.size(-1);
  FA_CHECK_ARG(history.dim() == 2 && history.size(0) == rows && history.size(1) >= 1, history,
               "have shape (rows, L) with rows = " + std::to_string(rows) + " and L >= 1",
               shape_str(history.sizes()));
  FA_CHECK_ARG((history.size(1) == 1 || history.stride(1) == 1) && (rows <= 1 || history.stride(0) >= history.size(1)),
               history, "have a last dim of stride 1 and rows that do not overlap (stride(0) >= L)",
               "strides " + shape_str(history.strides()));
  FA_CHECK_SAME_DEVICE(history_index, logits);
  FA_CHECK_ARG(history_index.scalar_type() == at::kInt || history_index.scalar_type() == at::kLong, history_index,
               "have dtype int32 or int64", dtype_str(history_index.scalar_type()));
  FA_CHECK_ARG(history_index.dim() == 1 && history_index.size(0) == rows, history_index,
               "have shape (rows,) with rows = " + std::to_string(rows), shape_str(history_index.sizes()));
  const std::pair<const char*, const at::Tensor*> others[] = {
      {"out", &out},
      {"advance", advance.has_value() ? &*advance : nullptr},
      {"logits", &logits},
      {"offsets", offsets.has_value() ? &*offsets : nullptr},
      {"history_index", &history_index}};
  for (const auto& [name, other] : others) {
    FA_CHECK_ARG(other == nullptr || !may_overlap(history, *other), history, std::string("not overlap ") + name,
                 "overlapping memory");
  }
  FA_CHECK_ARG(!may_overlap(history_index, out), history_index, "not overlap out", "overlapping memory");
  if (advance.has_value() && rows > 1 && may_overlap(history_index, *advance)) {
    FA_CHECK_ARG(own_row(history_index, *advance, rows), history_index,
                 "be one of advance's rows or not overlap it (every row must read its own index before it "
                 "advances its own counters)",
                 "an overlap of another shape");
  }
}

void launch(const at::Tensor& logits, double temperature, int64_t seed, int64_t offset,
            const std::optional<at::Tensor>& offsets_opt, int64_t top_k, const at::Tensor& out,
            const std::optional<at::Tensor>& advance = std::nullopt,
            const std::optional<at::Tensor>& history = std::nullopt,
            const std::optional<at::Tensor>& history_index = std::nullopt) {
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor l2 = logits.reshape({-1, logits.size(-1)});
  if (l2.size(1) > 1 && l2.stride(1) != 1) l2 = l2.contiguous();  // rows read with a contiguous last dim
  const at::Tensor o1 = out.view({-1});
  // One element or one per row, read with a stride (0 or 1) of a contiguous copy: a few bytes.
  const at::Tensor offsets = offsets_opt.has_value() ? offsets_opt->reshape({-1}).contiguous() : at::Tensor();

  SampleParams p{};
  p.logits = l2.data_ptr();
  p.out = o1.data_ptr<int64_t>();
  p.rows = l2.size(0);
  p.vocab = l2.size(1);
  p.row_stride = l2.stride(0);
  p.out_stride = o1.stride(0);
  p.offsets = offsets.defined() ? offsets.data_ptr() : nullptr;
  p.offsets_stride = offsets.defined() && offsets.numel() > 1 ? 1 : 0;
  p.offsets64 = offsets.defined() && offsets.scalar_type() == at::kLong;
  p.offset = static_cast<uint64_t>(offset);
  p.seed = static_cast<uint64_t>(seed);
  p.temperature = float(temperature);
  // Filtering only where it can drop a column: a draw (greedy ignores top_k) and fewer than vocab kept.
  p.top_k = temperature > 0 && top_k > 0 && top_k < p.vocab ? top_k : 0;
  if (advance.has_value() && advance->numel() > 0) {
    p.advance = advance->data_ptr();
    p.adv_k = int(advance->size(0));
    p.adv_stride_k = advance->stride(0);
    p.adv_stride_row = advance->stride(1);
    p.advance64 = advance->scalar_type() == at::kLong;
  }
  if (history.has_value()) {  // read in place (any stride): the index may be one of advance's rows
    p.history = history->data_ptr<int64_t>();
    p.history_stride = history->stride(0);
    p.history_len = history->size(1);
    p.history_index = history_index->data_ptr();
    p.history_index_stride = history_index->stride(0);
    p.history_index64 = history_index->scalar_type() == at::kLong;
  }

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  FA_DISPATCH_FLOAT(logits.scalar_type(), logits, [&] {
    // Where the kernel has sm_90 code on an sm_90 device, a row's blocks form a cluster (and the launch
    // is programmatic); elsewhere one block per row.
    const auto* prop = at::cuda::getDeviceProperties(logits.device().index());
    const bool sm90 = prop->major >= 9 && sample_sm90_capable<scalar_t>();
    // A row's blocks: sample_heuristics.h, given how many clusters of each size this device holds at once.
    const auto chunk_of = [&](int blocks) {  // whole 16-byte pieces where the rows allow it
      const int64_t per_block = (p.vocab + blocks - 1) / blocks;
      return (per_block + 7) / 8 * 8;
    };
    p.blocks_per_row = !sm90 ? 1 : sample_blocks_per_row(p.rows, p.vocab, prop->multiProcessorCount, [&](int b) {
      SampleParams q = p;
      q.blocks_per_row = b;
      q.chunk = chunk_of(b);
      return sample_clusters_at_once<scalar_t>(q);
    });
    p.cluster = p.blocks_per_row > 1;
    p.programmatic = sm90;
    p.chunk = chunk_of(p.blocks_per_row);
    launch_sample<scalar_t>(p, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::IntArrayRef row_shape(const at::Tensor& logits) { return logits.sizes().slice(0, logits.dim() - 1); }

}  // namespace

// Argument order follows the schemas in fused_attn/_ops.py (the only place schemas are defined).
at::Tensor sample(const at::Tensor& logits, double temperature, int64_t seed, int64_t offset,
                  const std::optional<at::Tensor>& offsets, int64_t top_k) {
  check_args(logits, temperature, seed, offset, offsets, top_k);
  at::Tensor out = at::empty(row_shape(logits), logits.options().dtype(at::kLong));
  launch(logits, temperature, seed, offset, offsets, top_k, out);
  return out;
}

void sample_out(const at::Tensor& logits, double temperature, int64_t seed, int64_t offset,
                const std::optional<at::Tensor>& offsets, int64_t top_k, const at::Tensor& out,
                const std::optional<at::Tensor>& advance, const std::optional<at::Tensor>& history,
                const std::optional<at::Tensor>& history_index) {
  check_args(logits, temperature, seed, offset, offsets, top_k);
  FA_CHECK_SAME_DEVICE(out, logits);
  FA_CHECK_ARG(out.scalar_type() == at::kLong, out, "have dtype int64", dtype_str(out.scalar_type()));
  FA_CHECK_SHAPE(out, row_shape(logits));
  FA_CHECK_CONTIGUOUS(out);
  if (advance.has_value()) check_advance(logits, offsets, out, *advance);
  FA_CHECK_ARG(history_index.has_value() || !history.has_value(), history_index, "be given with history", "None");
  FA_CHECK_ARG(history.has_value() || !history_index.has_value(), history, "be given with history_index", "None");
  if (history.has_value()) check_history(logits, offsets, out, advance, *history, *history_index);
  launch(logits, temperature, seed, offset, offsets, top_k, out, advance, history, history_index);
}

TORCH_LIBRARY_IMPL(fused_attn, CUDA, m) {
  m.impl("sample", &sample);
  m.impl("sample_out", &sample_out);
}

}  // namespace fused_attn
