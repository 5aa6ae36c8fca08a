// Argument checks for the CUDA launchers. Every message has the form
//   "<argument> must <requirement>, got <actual>"
// and is raised as a ValueError in Python (TORCH_CHECK_VALUE), so a caller can
// tell bad input from a kernel failure. Tests pin each message. Python validates an op's
// arguments first (fused_attn/<op>.py); the launchers keep the checks that guard memory
// safety for callers of torch.ops.fused_attn.* who bypass the wrapper.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace fused_attn {

// Python's spelling of a shape: "(2, 3)", "(5,)".
inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return s + (sizes.size() == 1 ? ",)" : ")");
}

// Numbers and devices are formatted here, not streamed into the message: streaming a
// double or int64 through the message's ostringstream crashed this extension on the
// GPU host (torch 2.11, nvcc 13.0); strings are safe.
inline std::string num_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
inline std::string num_str(int64_t v) { return std::to_string(v); }
inline std::string device_str(const at::Device& d) {
  return d.is_cpu() ? "cpu" : std::string(c10::DeviceTypeName(d.type(), true)) + ":" + std::to_string(d.index());
}

// Python's spelling of a dtype ("torch.float16"), so C++ and Python messages match.
inline std::string dtype_str(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

// Last dim contiguous, every other stride and the base 16-byte aligned: what kernels reading rows
// with 16-byte vector loads or cp.async need (dims of size 1 have no stride to check).
inline bool rows_aligned(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  const int64_t vec = 16 / t.element_size();
  if (t.size(-1) != 1 && t.stride(-1) != 1) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) % vec != 0) return false;
  }
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

}  // namespace fused_attn

// FA_CHECK_ARG(cond, arg, requirement, actual): the argument's name is stringified so a
// message can never name the wrong argument; requirement and actual are strings.
#define FA_CHECK_ARG(cond, arg, requirement, actual) \
  TORCH_CHECK_VALUE((cond), #arg " must ", requirement, ", got ", actual)

#define FA_CHECK_CUDA(arg)                                                      \
  FA_CHECK_ARG((arg).is_cuda(), arg, "be a CUDA tensor", ::fused_attn::device_str((arg).device()))

// `arg` has exactly `n` dims, e.g. FA_CHECK_DIM(q, 4, "[batch, nheads, seqlen_q, headdim]").
#define FA_CHECK_DIM(arg, n, layout)                                                          \
  FA_CHECK_ARG((arg).dim() == (n), arg, "have " #n " dims " layout,                           \
               ::fused_attn::shape_str((arg).sizes()))

// `arg` has the shape `want` (an at::IntArrayRef or a braced list of int64_t).
#define FA_CHECK_SHAPE(arg, want)                                                             \
  FA_CHECK_ARG((arg).sizes() == at::IntArrayRef(want), arg,                                   \
               "have shape " + ::fused_attn::shape_str(at::IntArrayRef(want)),                \
               ::fused_attn::shape_str((arg).sizes()))

// `arg` has `ref`'s dtype / is on `ref`'s device; the message names ref.
#define FA_CHECK_SAME_DTYPE(arg, ref)                                                         \
  FA_CHECK_ARG((arg).scalar_type() == (ref).scalar_type(), arg,                               \
               "have " #ref "'s dtype (" + ::fused_attn::dtype_str((ref).scalar_type()) + ")",\
               ::fused_attn::dtype_str((arg).scalar_type()))
#define FA_CHECK_SAME_DEVICE(arg, ref)                                                        \
  FA_CHECK_ARG((arg).device() == (ref).device(), arg,                                         \
               "be on the same device as " #ref " (" + ::fused_attn::device_str((ref).device()) + ")", \
               ::fused_attn::device_str((arg).device()))

// The last dim is contiguous (stride 1): rows can be read with vector loads; other strides are free.
#define FA_CHECK_LAST_DIM_CONTIGUOUS(arg)                                                     \
  FA_CHECK_ARG((arg).size(-1) <= 1 || (arg).stride(-1) == 1, arg,                             \
               "have a contiguous last dim (stride 1)",                                       \
               "strides " + ::fused_attn::shape_str((arg).strides()))

#define FA_CHECK_CONTIGUOUS(arg)                                                              \
  FA_CHECK_ARG((arg).is_contiguous(), arg, "be contiguous",                                   \
               "strides " + ::fused_attn::shape_str((arg).strides()))
