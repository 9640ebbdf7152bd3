// One-call CPU kernel for a few rows (cached decode): y[m, n] = sum over the input
// column segments that row m's type uses for output row n of x[m, :] . w[n, :].
//
// Reads exactly the weight blocks in the support of the rows' types (each weight row
// once, reused across the rows from L1), parallel over output rows with ATen's pool.
// The slow obvious version is structlm.ops.reference; tests compare the two.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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
void fused_rows_impl(const T* x, const T* w, const int64_t* types, const int32_t* out_group,
                     const int64_t* seg_ptr, const int64_t* seg_lo, const int64_t* seg_hi,
                     int64_t q, int64_t M, int64_t N, int64_t K, T* y) {
  // grain: >= 32 output rows per task so each thread streams long runs of weight rows
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const T* wr = w + n * K;
      const int64_t d = out_group[n];
      for (int64_t m = 0; m < M; ++m) {
        const int64_t cell = types[m] * q + d;
        const T* xr = x + m * K;
        T acc = 0;
        for (int64_t s = seg_ptr[cell]; s < seg_ptr[cell + 1]; ++s) {
          acc += dot_segment(xr + seg_lo[s], wr + seg_lo[s], seg_hi[s] - seg_lo[s]);
        }
        y[m * N + n] = acc;
      }
    }
  });
}

}  // namespace

// x (M, K), w (N, K), types (M,) int64 in [0, T), out_group (N,) int32 in [0, q),
// seg_ptr (T * q + 1,) int64, seg_lo / seg_hi (S,) int64 column ranges.  Returns (M, N).
torch::Tensor fused_rows_forward(torch::Tensor x, torch::Tensor w, torch::Tensor types,
                                 torch::Tensor out_group, torch::Tensor seg_ptr,
                                 torch::Tensor seg_lo, torch::Tensor seg_hi, int64_t q) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "fused_rows: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "fused_rows: x (M, K) and w (N, K) expected, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "fused_rows: dtype mismatch");
  TORCH_CHECK(types.scalar_type() == at::kLong && types.numel() == x.size(0),
              "fused_rows: one int64 type per row expected");
  TORCH_CHECK(out_group.scalar_type() == at::kInt && out_group.numel() == w.size(0),
              "fused_rows: one int32 output group per weight row expected");
  x = x.contiguous();
  w = w.contiguous();
  types = types.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_rows_forward", [&] {
    fused_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                              types.data_ptr<int64_t>(), out_group.data_ptr<int32_t>(),
                              seg_ptr.data_ptr<int64_t>(), seg_lo.data_ptr<int64_t>(),
                              seg_hi.data_ptr<int64_t>(), q, M, N, K, y.data_ptr<scalar_t>());
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_rows_forward", &fused_rows_forward,
        "y = x W_eff(type)^T for a few rows, reading only the support's weight blocks");
}
