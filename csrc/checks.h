// Argument checks for the CUDA launchers. Every message has the form
//   "<argument> must <requirement>, got <actual>"
// and is raised as a ValueError in Python (TORCH_CHECK_VALUE), so a caller can
// tell bad input from a kernel failure. Tests pin each message.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

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

// Python's spelling of a dtype ("torch.float16"), so C++ and Python messages match.
inline std::string dtype_str(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

}  // namespace fused_attn

// FA_CHECK_ARG(cond, arg, "requirement", actual...): the argument's name is
// stringified so a message can never name the wrong argument.
#define FA_CHECK_ARG(cond, arg, requirement, ...) \
  TORCH_CHECK_VALUE((cond), #arg " must " requirement ", got ", __VA_ARGS__)

#define FA_CHECK_CUDA(arg)                                                      \
  FA_CHECK_ARG((arg).is_cuda(), arg, "be a CUDA tensor", (arg).device())

#define FA_CHECK_SAME_DEVICE(arg, ref)                                          \
  FA_CHECK_ARG((arg).device() == (ref).device(), arg,                           \
               "be on the same device as " #ref " (", (ref).device(), ")",      \
               (arg).device())
