// One-call CPU kernel for a few rows (cached decode): y[m, n] = sum over the input
// groups b that row m's type uses for output group(n) of x[m, group b] . W[n, group b].
//
// The weight comes block-contiguous (each (output group, input group) block row-major
// on its own), so a type's rows stream through whole blocks: row-major [out, in] rows
// read in 192-float pieces cost as much memory traffic as the full rows (the
// prefetchers fetch the skipped lines too). Exactly the support's blocks are read,
// each weight row once per call (reused across the M rows from L1); parallel over
// output rows with ATen's pool.
// The slow obvious version is structlm.ops.reference; tests compare the two.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int64_t kLanes = 32;  // independent partial sums: 4 AVX2 / 2 AVX-512 registers

template <typename T>
inline T dot_segment(const T* __restrict a, const T* __restrict b, int64_t n) {
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma GCC unroll 32
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  T s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

template <typename T>
void fused_rows_impl(const T* x, const T* packed, const int64_t* types,
                     const int64_t* out_off, const int64_t* in_off, const int64_t* blk_off,
                     const uint8_t* uses, int64_t q, int64_t M, int64_t N, int64_t K, T* y) {
  // Each thread takes a range of output rows and streams, block by block, through the
  // rows of each block (d, b) some row's type uses: one contiguous run of memory at a
  // time, each block row loaded once and used for every row m that needs it.
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] = 0;
    }
    for (int64_t d = 0; d < q; ++d) {
      const int64_t lo = std::max(n0, out_off[d]), hi = std::min(n1, out_off[d + 1]);
      if (lo >= hi) continue;
      for (int64_t b = 0; b < q; ++b) {
        const int64_t width = in_off[b + 1] - in_off[b];
        const T* blk = packed + blk_off[d * q + b];
        for (int64_t m = 0; m < M; ++m) {
          if (!uses[(types[m] * q + d) * q + b]) continue;
          const T* xb = x + m * K + in_off[b];
          T* yr = y + m * N;
          for (int64_t n = lo; n < hi; ++n) {
            yr[n] += dot_segment(xb, blk + (n - out_off[d]) * width, width);
          }
        }
      }
    }
  });
}

}  // namespace

// x (M, K); packed: the weight (N, K) stored block by block (block (d, b) = rows of
// output group d, columns of input group b, row-major, at packed[blk_off[d*q + b]]);
// types (M,) int64 in [0, q); out_off / in_off (q + 1,) int64 group offsets; uses
// (q, q, q) uint8: uses[a][d][b] = type a reads block (d, b).  Returns y (M, N).
torch::Tensor fused_rows_forward(torch::Tensor x, torch::Tensor packed, torch::Tensor types,
                                 torch::Tensor out_off, torch::Tensor in_off,
                                 torch::Tensor blk_off, torch::Tensor uses, int64_t q) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(),
              "fused_rows: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2, "fused_rows: x (M, K) expected, got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(in_off.numel() == q + 1 && out_off.numel() == q + 1,
              "fused_rows: q + 1 group offsets expected");
  const int64_t N = out_off.data_ptr<int64_t>()[q];
  const int64_t covered = in_off.data_ptr<int64_t>()[q];
  TORCH_CHECK(covered == K, "fused_rows: x has ", K,
              " columns but the layer's input groups cover ", covered);
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == N * K,
              "fused_rows: packed weight of ", N * K, " elements expected, got ",
              packed.numel());
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "fused_rows: dtype mismatch: x is ",
              x.scalar_type(), ", the weight ", packed.scalar_type());
  TORCH_CHECK(types.scalar_type() == at::kLong && types.numel() == M,
              "fused_rows: one int64 type per row expected");
  TORCH_CHECK(out_off.is_contiguous() && in_off.is_contiguous() && blk_off.is_contiguous() &&
                  uses.is_contiguous(),
              "fused_rows: contiguous tables expected");
  TORCH_CHECK(uses.scalar_type() == at::kByte && uses.numel() % (q * q) == 0,
              "fused_rows: a uint8 (types, q, q) block-use table expected");
  x = x.contiguous();
  types = types.contiguous();
  auto y = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_rows_forward", [&] {
    fused_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), packed.data_ptr<scalar_t>(),
                              types.data_ptr<int64_t>(), out_off.data_ptr<int64_t>(),
                              in_off.data_ptr<int64_t>(), blk_off.data_ptr<int64_t>(),
                              uses.data_ptr<uint8_t>(), q, M, N, K, y.data_ptr<scalar_t>());
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_rows_forward", &fused_rows_forward,
        "y = x W_eff(type)^T for a few rows, reading only the support's weight blocks");
}
