// The Python module of the compiled CPU kernels: the few-row products (fused_rows.cpp),
// a layer's decode call bound once (`TypedRowsBinding`), the decode SwiGLU FFN in one
// call, and the decode steps (decode_block.cpp, decode_hf.cpp). The Python side is
// structlm.ops.cpu_kernels.
#include <torch/extension.h>

#include "panel.h"
#include "rows_kernel.h"

#include <cmath>
#include <vector>

// A layer's few-row product bound once (cached decode of an algebra layer): the typed
// copies, the support and every type's row lengths and copy offset are fixed at
// construction, so a call is one Python -> C++ crossing that checks only what can change
// between calls. Measured with the caches flushed before each call (a decode step
// streams more weight than the last-level cache holds): the Python gate and wrapper of
// the unbound path cost ~0.5 ms a call cold, more than reading Q32's 4 MiB of weight.
class TypedRowsBinding {
 public:
  TypedRowsBinding(at::Tensor weight, at::Tensor typed, at::Tensor out_off, at::Tensor in_off,
                   at::Tensor uses, int64_t q, int64_t max_rows)
      : weight_(std::move(weight)),
        rows_(std::move(typed), std::move(out_off), std::move(in_off), std::move(uses), q, -1),
        max_rows_(max_rows) {
    TORCH_CHECK(weight_.dim() == 2 && weight_.size(0) == rows_.out_features() &&
                    weight_.size(1) == rows_.in_features() &&
                    weight_.scalar_type() == rows_.typed().scalar_type(),
                "TypedRowsBinding: weight (", rows_.out_features(), ", ", rows_.in_features(),
                ") of the copies' dtype expected, got ", weight_.sizes());
    version_ = weight_._version();
    data_ = weight_.data_ptr();
  }

  // Whether `weight` is the bound one, unchanged since the copies were made.
  bool matches(const at::Tensor& weight) const {
    return weight.unsafeGetTensorImpl() == weight_.unsafeGetTensorImpl() &&
           weight._version() == version_ && weight.data_ptr() == data_ && weight.is_contiguous();
  }

  // y (*, N) for x (*, K) whose rows all have one type (a dense weight, bound with the
  // one-group support, ignores `types`), or None where the binding does not apply (then
  // the caller takes its general path): another weight, or this one changed
  // since the copies were made (in-place update, .data swap); x not a CPU tensor of the
  // weight's dtype with K columns and 1..max_rows rows; autograd recording; types not
  // one int64 per row, all equal, in range; a bias not contiguous, of another dtype or
  // size.
  c10::optional<at::Tensor> call(const at::Tensor& x, const at::Tensor& types,
                                 const at::Tensor& weight,
                                 const c10::optional<at::Tensor>& bias) const {
    const int64_t N = rows_.out_features(), K = rows_.in_features();
    if (!matches(weight)) return c10::nullopt;
    if (!x.device().is_cpu() || x.layout() != at::kStrided ||
        x.scalar_type() != weight_.scalar_type() || x.dim() < 1 || x.size(-1) != K) {
      return c10::nullopt;
    }
    const int64_t M = x.numel() / K;
    if (M < 1 || M > max_rows_) return c10::nullopt;
    const bool bias_grad = bias.has_value() && bias->requires_grad();
    if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias_grad)) {
      return c10::nullopt;
    }
    if (bias.has_value() && (!bias->device().is_cpu() || !bias->is_contiguous() ||
                             bias->scalar_type() != x.scalar_type() || bias->numel() != N)) {
      return c10::nullopt;
    }
    int64_t a = 0;  // a dense weight (one type, one group): `types` is not read
    if (rows_.n_types() > 1) {
      if (!types.device().is_cpu() || types.scalar_type() != at::kLong ||
          types.numel() != M || !types.is_contiguous()) {
        return c10::nullopt;
      }
      const int64_t* t = types.data_ptr<int64_t>();
      a = t[0];
      if (a < 0 || a >= rows_.n_types()) return c10::nullopt;
      for (int64_t m = 1; m < M; ++m) {
        if (t[m] != a) return c10::nullopt;
      }
    }
    auto y = rows_.forward(x.reshape({M, K}).contiguous(), a, bias);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    return y.view(shape);
  }

 private:
  at::Tensor weight_;
  structlm::BoundRows rows_;
  int64_t max_rows_ = 0, version_ = 0;
  const void* data_ = nullptr;
};

// Decode SwiGLU FFN in one call: down(silu(gate(x)) * up(x)), each projection from the
// typed copies (`typed`; every row one type) or the panel-packed ones (gate and up share
// the tables `gu_*`, down has `dn_*`; a dense FFN passes its weights and the trivial
// one-group tables, so both run the same code).
at::Tensor swiglu_rows_forward(at::Tensor x, at::Tensor gate, at::Tensor up, at::Tensor down,
                               at::Tensor types, at::Tensor gu_out_off, at::Tensor gu_in_off,
                               at::Tensor gu_uses, at::Tensor dn_out_off,
                               at::Tensor dn_in_off, at::Tensor dn_uses, int64_t q, bool typed) {
  const c10::optional<at::Tensor> none;
  auto project = typed ? &typed_rows_forward : &fused_rows_forward;
  auto g = project(x, gate, types, gu_out_off, gu_in_off, gu_uses, q, none);
  auto u = project(x, up, types, gu_out_off, gu_in_off, gu_uses, q, none);
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "swiglu_rows_forward", [&] {
    scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* up_ = u.data_ptr<scalar_t>();
    const int64_t n = g.numel();
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t v = gp[i];
      gp[i] = v / (scalar_t(1) + std::exp(-v)) * up_[i];
    }
  });
  return project(g, down, types, dn_out_off, dn_in_off, dn_uses, q, none);
}

// decode_hf.cpp: the Hugging Face decoders' decode step classes
void register_decode_hf(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu_rows_forward", &swiglu_rows_forward,
        "down(silu(gate(x)) * up(x)) for a few rows, each projection support-driven");
  m.def("fused_rows_forward", &fused_rows_forward,
        "y = x W_eff(type)^T (+ bias) for a few rows of any types, panel-packed weight");
  m.def("typed_rows_forward", &typed_rows_forward,
        "y = x W_eff(type)^T (+ bias) for a few rows of one type, from the typed copies");
  m.def("dense_rows_forward", &dense_rows_forward, "y = x W^T (+ bias) for a few rows");
  // whether this build has the AVX-512 paired-panel and type-by-type loops (float32)
  m.attr("paired_panels") = structlm::kPairedPanels;
  py::class_<TypedRowsBinding>(m, "TypedRowsBinding",
                               "a layer's few-row product of one type, bound once")
      .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
                    int64_t>())
      .def("__call__", &TypedRowsBinding::call, py::arg("x"), py::arg("types"),
           py::arg("weight"), py::arg("bias"))
      .def("matches", &TypedRowsBinding::matches, py::arg("weight"));
  register_decode_hf(m);
  m.def("decode_stack_forward", &decode_stack_forward,
        "every decoder block in turn for one new token per sequence, caches written in place");
}
