// The compiled CPU decode kernels of structlm (one extension, two translation units):
// fused_rows.cpp has the few-row products, decode_block.cpp one decoder block's decode
// step built on them. The Python side is structlm.ops.cpu_kernels.
#pragma once

#include <ATen/ATen.h>

#include <vector>

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
