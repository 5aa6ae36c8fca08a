// The direct path: the ops' CUDA implementations (csrc/common/ops.h) as functions of a Python module,
// called by the Python wrappers (fused_attn/<op>.py) without going through the dispatcher. An eager call
// through torch.ops costs the boxed argument parsing and the Python autograd kernel torch.library
// registers, ~10-20 us a call on an H200 host against ~10 us for a whole F.layer_norm
// (dev/probe_host_paths.py). A call here is the launcher's own work: its checks (the same messages),
// the allocation and the launch on the current stream.
//
// Each function first decides whether the call may skip the dispatcher, and returns None when not (the
// wrapper then calls torch.ops, which does everything the dispatcher does):
// - every tensor argument is a torch.Tensor or nn.Parameter (no subclass: a subclass may redefine the
//   op through __torch_function__ / __torch_dispatch__) whose dispatch keys are CUDA's, autograd's and
//   autocast's only (no functorch, functionalization, fake, meta, conjugate or nested tensor);
// - none requires grad while grad mode is on (the backward is registered with the dispatcher);
// - no dispatch mode, torch function mode or dispatch key is pushed on this thread (a mode must see
//   the op), beyond the two keys a thread always includes: BackendSelect, and ADInplaceOrView outside
//   inference mode.
// torch.compile never gets here: the wrappers test torch.compiler.is_compiling() first.
// Ops that write into an argument (the caches of decode_attention's append and qkv_decode_attention) bump
// its version counter, as the dispatcher's ADInplaceOrView kernel does for a schema's mutable arguments.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <tuple>

#include "../common/ops.h"

namespace fused_attn {

namespace {

namespace py = pybind11;

bool modes_off() {
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  const c10::DispatchKeySet always({c10::DispatchKey::BackendSelect, c10::DispatchKey::ADInplaceOrView});
  return (tls.included_ - always).empty() &&
         c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !at::impl::torch_function_mode_enabled();
}

// Collects the tensor arguments of one call; `ok` turns false at the first one the direct path must not
// take (then the values are not used).
struct Args {
  bool ok = modes_off();
  const bool grad = c10::GradMode::is_enabled();

  at::Tensor tensor(py::handle h) {
    if (!ok || !THPVariable_CheckExact(h.ptr())) {
      ok = false;
      return {};
    }
    at::Tensor t = THPVariable_Unpack(h.ptr());
    const c10::DispatchKeySet rest =
        t.key_set() - c10::autograd_dispatch_keyset_with_ADInplaceOrView - c10::autocast_dispatch_keyset;
    if (rest != c10::DispatchKeySet(c10::DispatchKey::CUDA) || (grad && t.requires_grad())) ok = false;
    return t;
  }
  std::optional<at::Tensor> optional(py::handle h) {
    if (h.is_none()) return std::nullopt;
    return tensor(h);
  }
};

py::object wrap(at::Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }
py::object wrap(std::tuple<at::Tensor, at::Tensor> t) {
  return py::make_tuple(wrap(std::move(std::get<0>(t))), wrap(std::move(std::get<1>(t))));
}

// Argument order: the schemas' (fused_attn/_ops.py), keyword-only arguments included.
py::object direct_layer_norm(py::handle x, py::handle weight, py::handle bias, double eps, bool rms) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor x_ = a.tensor(x);
  auto w = a.optional(weight), b = a.optional(bias);
  if (!a.ok) return py::none();
  return wrap(layer_norm(x_, w, b, eps, rms));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_add_layer_norm(py::handle x, py::handle residual, py::handle weight, py::handle bias, double eps,
                                 py::handle x_index, py::handle residual_index, bool rms) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor x_ = a.tensor(x), r = a.tensor(residual);
  auto w = a.optional(weight), b = a.optional(bias), xi = a.optional(x_index), ri = a.optional(residual_index);
  if (!a.ok) return py::none();
  return wrap(add_layer_norm(x_, r, w, b, eps, xi, ri, rms));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_linear(py::handle x, py::handle weight, py::handle bias, py::handle residual,
                         py::handle norm_weight, py::handle norm_bias, int64_t activation, int64_t norm, double eps) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor x_ = a.tensor(x), w = a.tensor(weight);
  auto b = a.optional(bias), r = a.optional(residual), nw = a.optional(norm_weight), nb = a.optional(norm_bias);
  if (!a.ok) return py::none();
  return wrap(linear(x_, w, b, r, nw, nb, activation, norm, eps));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_mlp(py::handle x, py::handle w_fc, py::handle b_fc, py::handle w_proj, py::handle b_proj,
                      py::handle residual, int64_t activation) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor x_ = a.tensor(x), wf = a.tensor(w_fc), wp = a.tensor(w_proj);
  auto bf = a.optional(b_fc), bp = a.optional(b_proj), r = a.optional(residual);
  if (!a.ok) return py::none();
  return wrap(mlp(x_, wf, bf, wp, bp, r, activation));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_scaled_masked_softmax(py::handle x, double scale, py::handle attn_mask, bool causal,
                                        int64_t version) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor x_ = a.tensor(x);
  auto m = a.optional(attn_mask);
  if (!a.ok) return py::none();
  return wrap(scaled_masked_softmax(x_, scale, m, causal, version));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_attention(py::handle q, py::handle k, py::handle v, py::handle attn_mask, std::optional<double> scale,
                            bool causal, const std::string& algo, bool return_lse) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor q_ = a.tensor(q), k_ = a.tensor(k), v_ = a.tensor(v);
  auto m = a.optional(attn_mask);
  if (!a.ok) return py::none();
  return wrap(attention(q_, k_, v_, m, scale, causal, algo, return_lse));
  END_HANDLE_TH_ERRORS_PYBIND
}

// attention(out=): the kernel writes into the caller's out (any strides with a contiguous last dim, e.g. a
// transposed [batch, seqlen, heads, headdim] buffer), which is returned; its version counter is bumped as for
// a schema's mutable argument. Returns (out, lse), lse empty unless return_lse.
py::object direct_attention_out(py::handle q, py::handle k, py::handle v, py::handle attn_mask,
                                std::optional<double> scale, bool causal, const std::string& algo, bool return_lse,
                                py::handle out) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor q_ = a.tensor(q), k_ = a.tensor(k), v_ = a.tensor(v), o = a.tensor(out);
  auto m = a.optional(attn_mask);
  // lse is sized from q before the op's checks run: a q that is not 4-D goes to the wrapper's message.
  if (!a.ok || q_.dim() != 4) return py::none();
  at::Tensor lse = return_lse ? at::empty({q_.size(0), q_.size(1), q_.size(2)}, q_.options().dtype(at::kFloat))
                              : at::empty({0}, q_.options().dtype(at::kFloat));
  attention_out(q_, k_, v_, m, scale, causal, algo, o, lse);
  o.unsafeGetTensorImpl()->bump_version();
  // (out, lse) as direct_attention returns: the wrapper picks out when return_lse is false.
  return py::make_tuple(py::reinterpret_borrow<py::object>(out), wrap(std::move(lse)));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_sample(py::handle logits, double temperature, int64_t seed, int64_t offset, py::handle offsets,
                         int64_t top_k) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor l = a.tensor(logits);
  auto o = a.optional(offsets);
  if (!a.ok) return py::none();
  return wrap(sample(l, temperature, seed, offset, o, top_k));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_qkv_decode_attention(py::handle x, py::handle w_qkv, py::handle b_qkv, py::handle k_cache,
                                       py::handle v_cache, py::handle cache_seqlens, py::handle cache_leftpad,
                                       double eps, double scale) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor x_ = a.tensor(x), w = a.tensor(w_qkv), kc = a.tensor(k_cache), vc = a.tensor(v_cache),
             lens = a.tensor(cache_seqlens);
  auto b = a.optional(b_qkv), lp = a.optional(cache_leftpad);
  if (!a.ok) return py::none();
  at::Tensor out = qkv_decode_attention(x_, w, b, kc, vc, lens, lp, eps, scale);
  kc.unsafeGetTensorImpl()->bump_version();
  vc.unsafeGetTensorImpl()->bump_version();
  return wrap(std::move(out));
  END_HANDLE_TH_ERRORS_PYBIND
}

py::object direct_decode_attention(py::handle q, py::handle k_cache, py::handle v_cache, py::handle cache_seqlens,
                                   py::handle k_new, py::handle v_new, py::handle cache_leftpad, py::handle key_mask,
                                   std::optional<double> scale, int64_t num_splits, py::handle block_table) {
  HANDLE_TH_ERRORS
  Args a;
  at::Tensor q_ = a.tensor(q), kc = a.tensor(k_cache), vc = a.tensor(v_cache);
  auto lens = a.optional(cache_seqlens), kn = a.optional(k_new), vn = a.optional(v_new),
       lp = a.optional(cache_leftpad), km = a.optional(key_mask), bt = a.optional(block_table);
  if (!a.ok) return py::none();
  // A ragged batch (cu_seqlens_q) never comes here: the wrapper takes the dispatcher path for it.
  at::Tensor out = decode_attention(q_, kc, vc, lens, kn, vn, lp, km, scale, num_splits, bt, std::nullopt, 0);
  if (kn.has_value()) {  // the append wrote the caches
    kc.unsafeGetTensorImpl()->bump_version();
    vc.unsafeGetTensorImpl()->bump_version();
  }
  return wrap(std::move(out));
  END_HANDLE_TH_ERRORS_PYBIND
}

}  // namespace

}  // namespace fused_attn

// The module's name is the library's (fused_attn/build.py LIB_NAME): fused_attn._ops imports the loaded
// library file under that name.
PYBIND11_MODULE(fused_attn_C, m) {
  using namespace fused_attn;
  m.doc() = "fused_attn's direct path: the CUDA ops without the dispatcher (None where it must run them)";
  m.def("layer_norm", &direct_layer_norm);
  m.def("add_layer_norm", &direct_add_layer_norm);
  m.def("linear", &direct_linear);
  m.def("mlp", &direct_mlp);
  m.def("scaled_masked_softmax", &direct_scaled_masked_softmax);
  m.def("attention", &direct_attention);
  m.def("attention_out", &direct_attention_out);
  m.def("sample", &direct_sample);
  m.def("decode_attention", &direct_decode_attention);
  m.def("qkv_decode_attention", &direct_qkv_decode_attention);
}
