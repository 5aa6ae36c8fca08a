// Argument checks for the CUDA launchers. Every message has the form
//   "<argument> must <requirement>, got <actual>"
// and is raised as a ValueError in Python (TORCH_CHECK_VALUE), so a caller can
// tell bad input from a kernel failure. Tests pin each message.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
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

}  // namespace fused_attn

// FA_CHECK_ARG(cond, arg, requirement, actual): the argument's name is stringified so a
// message can never name the wrong argument; requirement and actual are strings.
#define FA_CHECK_ARG(cond, arg, requirement, actual) \
  TORCH_CHECK_VALUE((cond), #arg " must ", requirement, ", got ", actual)

#define FA_CHECK_CUDA(arg)                                                      \
  FA_CHECK_ARG((arg).is_cuda(), arg, "be a CUDA tensor", ::fused_attn::device_str((arg).device()))
