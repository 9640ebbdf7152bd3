// The compiled CPU decode kernels of structlm (one extension, four translation units):
// fused_rows.cpp has the few-row products, decode_block.cpp one decoder block's decode
// step built on them, decode_hf.cpp the Hugging Face decoders' step, bindings.cpp the
// Python module (and a layer's bound decode call). The Python side is
// structlm.ops.cpu_kernels.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace structlm {

// The block support of a weight: q output and input groups (offsets (q + 1,) each) and
// uses[a][d][b] = type a reads block (d, b), for every type a.
struct Support {
  int64_t q;
  const int64_t* out_off;  // (q + 1,)
  const int64_t* in_off;   // (q + 1,)
  const uint8_t* uses;     // (types, q, q)
};

// One weight bound for few-row products of one type: its typed copies (every type's
// blocks, concatenated per row; a dense weight is its own copy, one type, one group) and
// support, with every type's row lengths and copy offset fixed at construction, so a call
// is the kernel alone. `slot`: which column of a decode step's type table gives this
// weight's type (-1: one type). Defined in fused_rows.cpp.
class BoundRows {
 public:
  BoundRows(at::Tensor typed, at::Tensor out_off, at::Tensor in_off, at::Tensor uses,
            int64_t q, int64_t slot);
  int64_t out_features() const { return N_; }
  int64_t in_features() const { return K_; }
  int64_t n_types() const { return n_types_; }
  int64_t slot() const { return slot_; }
  const at::Tensor& typed() const { return typed_; }
  // y (M, N) = x W_eff(type)^T (+ bias) for x (M, K) contiguous of the copies' dtype,
  // `type` in [0, n_types) and a contiguous bias of N elements (checked by the caller).
  at::Tensor forward(const at::Tensor& x, int64_t type,
                     const c10::optional<at::Tensor>& bias) const;

 private:
  at::Tensor typed_, out_off_, in_off_, uses_;
  Support s_{};
  std::vector<int64_t> lengths_, base_;
  int64_t N_ = 0, K_ = 0, n_types_ = 0, slot_ = -1;
};

}  // namespace structlm

// y = x W_eff(type)^T (+ bias) for a few rows; see fused_rows.cpp.
at::Tensor fused_rows_forward(at::Tensor x, at::Tensor packed, at::Tensor types,
                              at::Tensor out_off, at::Tensor in_off, at::Tensor uses,
                              int64_t q, c10::optional<at::Tensor> bias);

// The same for rows of one type, from the typed copies; see fused_rows.cpp.
at::Tensor typed_rows_forward(at::Tensor x, at::Tensor typed, at::Tensor types,
                              at::Tensor out_off, at::Tensor in_off, at::Tensor uses,
                              int64_t q, c10::optional<at::Tensor> bias);

// y = x W^T (+ bias) for a few rows, W (N, K) row-major, on the typed loop.
at::Tensor dense_rows_forward(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);

// down(silu(gate(x)) * up(x)) for a few rows; `tables` = the gate/up support's
// (out_off, in_off, uses), then the down support's; `typed`: the weights are
// typed copies (every row one type), else panel-packed.
at::Tensor swiglu_rows_forward(at::Tensor x, at::Tensor gate, at::Tensor up, at::Tensor down,
                               at::Tensor types, at::Tensor gu_out_off, at::Tensor gu_in_off,
                               at::Tensor gu_uses, at::Tensor dn_out_off,
                               at::Tensor dn_in_off, at::Tensor dn_uses, int64_t q, bool typed);

// All blocks of a decoder in turn; returns the output and every block's keys and values.
std::vector<at::Tensor> decode_stack_forward(
    at::Tensor x, std::vector<std::vector<at::Tensor>> dense, std::vector<double> ln_eps,
    std::vector<at::Tensor> k_bufs, std::vector<at::Tensor> v_bufs, int64_t past,
    std::vector<std::vector<at::Tensor>> ffn, at::Tensor types, int64_t q, bool typed);
