// One pre-norm decoder block for one new token per sequence (cached CPU decode), in one
// call:  x += proj(attention(qkv(ln_1(x)), cache));  x += ffn(ln_2(x)).
// The projections are the few-row kernel of fused_rows.cpp (dense rows for qkv and proj;
// the FFN dense or support-driven, so dense and algebra models run the same code); the
// new key and value are written into the cache's spare capacity; attention over the
// cached keys is exact softmax(q k^T / sqrt(hs)) v per (sequence, head).
// Replaces ~25 small PyTorch ops per block and step (layer norms, views, the cache
// append, SDPA, residual adds), each a few microseconds of dispatch.
// The slow obvious version is the model's own forward; tests compare the two.
#include "dot.h"
#include "norms.h"
#include "rows_kernel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace {

using structlm::layer_norm_rows;

// For sequence m and head h: writes k, v at cache position `past`, then
// out[m, h*hs:(h+1)*hs] = softmax(q . K[0..past] / sqrt(hs)) V[0..past].
// qkv: (M, 3D) as [q | k | v], each (n_head, hs); caches (M, n_head, cap, hs).
// Scores with the SIMD dot, the softmax of all heads in one ATen call (vectorised exp;
// a scalar exp per score was ~40% of the attention time), then the weighted sum of V.
template <typename T>
void attend(const T* qkv, T* kc, T* vc, int64_t M, int64_t n_head, int64_t hs, int64_t cap,
            int64_t past, const at::TensorOptions& options, T* out) {
  const int64_t d = n_head * hs, keys = past + 1;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  auto scores = at::empty({M * n_head, keys}, options);  // (M * n_head, keys)
  T* sc = scores.data_ptr<T>();
  at::parallel_for(0, M * n_head, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / n_head, h = i % n_head;
      const T* q = qkv + m * 3 * d + h * hs;
      T* kh = kc + (m * n_head + h) * cap * hs;
      T* vh = vc + (m * n_head + h) * cap * hs;
      std::copy(q + d, q + d + hs, kh + past * hs);
      std::copy(q + 2 * d, q + 2 * d + hs, vh + past * hs);
      for (int64_t s = 0; s < keys; ++s) {
        sc[i * keys + s] = structlm::dot1<T>(q, kh + s * hs, hs) * scale;
      }
    }
  });
  const auto probs = at::softmax(scores, 1);  // (M * n_head, keys)
  const T* pr = probs.data_ptr<T>();
  at::parallel_for(0, M * n_head, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / n_head, h = i % n_head;
      const T* __restrict vh = vc + (m * n_head + h) * cap * hs;
      const T* __restrict p = pr + i * keys;
      T* __restrict o = out + m * d + h * hs;
      std::fill(o, o + hs, T(0));
      for (int64_t s = 0; s < keys; ++s) {
        for (int64_t e = 0; e < hs; ++e) o[e] += p[s] * vh[s * hs + e];
      }
    }
  });
}

void check_param(const at::Tensor& t, const at::Tensor& x, int64_t numel, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == x.scalar_type() &&
                  t.numel() == numel,
              "decode_block: ", what, ": a contiguous CPU tensor of ", numel,
              " elements and dtype ", x.scalar_type(), " expected, got ", t.sizes(), " ",
              t.scalar_type());
}

// x (M, D): one new token for each of M sequences, none padded (every sequence attends
// to all `past` cached positions and itself).
// dense: ln_1 weight, ln_1 bias, qkv weight (3D, D), qkv bias, proj weight (D, D), proj
// bias, ln_2 weight, ln_2 bias.  k_buf / v_buf: (M, n_head, cap, hs) with cap > past;
// position `past` is written.  ffn: gate, up, down weights (dense, typed or panel-packed)
// then the gate/up and down tables (out_off, in_off, uses each); types (M,)
// int64; q the number of types (1 for a dense FFN); typed: the FFN weights are typed
// copies (every row one type).  Returns the block's output (M, D).
at::Tensor decode_block_forward(at::Tensor x, std::vector<at::Tensor> dense, double ln_eps,
                                at::Tensor k_buf, at::Tensor v_buf, int64_t past,
                                std::vector<at::Tensor> ffn, at::Tensor types, int64_t q,
                                bool typed) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "decode_block: x (M, D) on the CPU expected");
  TORCH_CHECK(dense.size() == 8, "decode_block: 8 dense parameters expected, got ", dense.size());
  TORCH_CHECK(ffn.size() == 9, "decode_block: 3 FFN weights and 6 tables expected, got ",
              ffn.size());
  x = x.contiguous();
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(k_buf.dim() == 4 && k_buf.size(0) == M && k_buf.sizes() == v_buf.sizes() &&
                  k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  k_buf.scalar_type() == x.scalar_type() &&
                  v_buf.scalar_type() == x.scalar_type(),
              "decode_block: contiguous caches (M, n_head, cap, hs) of x's dtype expected, got ",
              k_buf.sizes(), " and ", v_buf.sizes());
  const int64_t n_head = k_buf.size(1), cap = k_buf.size(2), hs = k_buf.size(3);
  TORCH_CHECK(n_head * hs == D, "decode_block: n_head * head_size = ", n_head * hs,
              " but x has width ", D);
  TORCH_CHECK(past >= 0 && past < cap, "decode_block: position ", past,
              " is outside the cache's capacity ", cap);
  const int64_t sizes[8] = {D, D, 3 * D * D, 3 * D, D * D, D, D, D};
  const char* names[8] = {"ln_1.weight", "ln_1.bias", "qkv.weight", "qkv.bias",
                          "proj.weight", "proj.bias", "ln_2.weight", "ln_2.bias"};
  for (int i = 0; i < 8; ++i) check_param(dense[i], x, sizes[i], names[i]);

  auto h = at::empty_like(x);
  auto y = x.clone();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decode_block_ln_1", [&] {
    layer_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), dense[0].data_ptr<scalar_t>(),
                              dense[1].data_ptr<scalar_t>(), ln_eps, M, D,
                              h.data_ptr<scalar_t>());
  });
  auto qkv = dense_rows_forward(h, dense[2].view({3 * D, D}), dense[3]);  // (M, 3D)
  auto att = at::empty_like(x);                                           // (M, D)
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decode_block_attend", [&] {
    attend<scalar_t>(qkv.data_ptr<scalar_t>(), k_buf.data_ptr<scalar_t>(),
                     v_buf.data_ptr<scalar_t>(), M, n_head, hs, cap, past, x.options(),
                     att.data_ptr<scalar_t>());
  });
  y.add_(dense_rows_forward(att, dense[4].view({D, D}), dense[5]));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decode_block_ln_2", [&] {
    layer_norm_rows<scalar_t>(y.data_ptr<scalar_t>(), dense[6].data_ptr<scalar_t>(),
                              dense[7].data_ptr<scalar_t>(), ln_eps, M, D,
                              h.data_ptr<scalar_t>());
  });
  y.add_(swiglu_rows_forward(h, ffn[0], ffn[1], ffn[2], types, ffn[3], ffn[4], ffn[5], ffn[6],
                             ffn[7], ffn[8], q, typed));
  return y;
}

}  // namespace

// Every block of a decoder in turn (the lists hold one entry per block; all caches hold
// `past` positions). Returns the last block's output (M, D) followed by each block's
// keys and values over positions 0 .. past, views of the caches (M, n_head, past + 1, hs):
// keys_0, values_0, keys_1, ...
std::vector<at::Tensor> decode_stack_forward(
    at::Tensor x, std::vector<std::vector<at::Tensor>> dense, std::vector<double> ln_eps,
    std::vector<at::Tensor> k_bufs, std::vector<at::Tensor> v_bufs, int64_t past,
    std::vector<std::vector<at::Tensor>> ffn, at::Tensor types, int64_t q, bool typed) {
  const size_t n = dense.size();
  TORCH_CHECK(
      ln_eps.size() == n && k_bufs.size() == n && v_bufs.size() == n && ffn.size() == n,
      "decode_stack: one entry per block expected in every list");
  std::vector<at::Tensor> out;
  out.reserve(1 + 2 * n);
  out.push_back(x);
  for (size_t i = 0; i < n; ++i) {
    out[0] = decode_block_forward(out[0], dense[i], ln_eps[i], k_bufs[i], v_bufs[i], past,
                                  ffn[i], types, q, typed);
    out.push_back(k_bufs[i].narrow(2, 0, past + 1));
    out.push_back(v_bufs[i].narrow(2, 0, past + 1));
  }
  return out;
}
