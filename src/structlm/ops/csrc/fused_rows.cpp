// One-call CPU kernel for a few rows (cached decode): y[m, n] = sum over the input
// groups b that row m's type uses for output group(n) of x[m, group b] . W[n, group b]
// (+ bias[n]).  The same loop with the trivial support (one group, one block) is the
// dense GEMV `dense_rows_forward`, so dense and algebra layers are timed on one kernel.
//
// The weight comes block-contiguous (each (output group, input group) block row-major
// on its own), so a type's rows stream through whole blocks: row-major [out, in] rows
// read in 192-float pieces cost as much memory traffic as the full rows (the
// prefetchers fetch the skipped lines too). Exactly the support's blocks are read,
// each weight row once per call (kept in L1 for every row m that uses it).
// Parallel over output rows: each thread takes its slice of every output group (the
// rows of a group all use the same blocks, so the work is even whatever the types;
// measured a few percent faster than 64-row chunks dealt round-robin, which leave the
// threads unequal when a group has an odd number of chunks). Built with -fopenmp: without
// it ATen's parallel_for runs serially inside an extension (measured: 9 GB/s instead
// of 16 GB/s on 2 cores).
// The slow obvious version is structlm.ops.reference; tests compare the two.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STRUCTLM_AVX2 1
#endif

namespace {

constexpr int64_t kLanes = 32;     // independent partial sums in the portable dot
constexpr int64_t kChunkRows = 64;  // output rows per accumulator pass (measured: 16-256)

// Portable dot product (double, or float without AVX2): GCC vectorises the lanes.
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

// x . w over n elements (one weight row: reads it front to back).
template <typename T>
inline T dot1(const T* __restrict x, const T* __restrict w, int64_t n) {
  return dot_segment(x, w, n);
}

// out[r] += x . w[r * ld : r * ld + n] for r < 4.
template <typename T>
inline void dot4(const T* __restrict x, const T* __restrict w, int64_t ld, int64_t n,
                 T* __restrict out) {
  for (int64_t r = 0; r < 4; ++r) out[r] += dot_segment(x, w + r * ld, n);
}

#ifdef STRUCTLM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <>
inline float dot1<float>(const float* __restrict x, const float* __restrict w, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(w + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(w + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(w + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), s0);
  }
  float t = 0;
  for (; i < n; ++i) t += x[i] * w[i];
  return hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3))) + t;
}

// Four weight rows against one x: each x vector is loaded once for four FMAs.
template <>
inline void dot4<float>(const float* __restrict x, const float* __restrict w, int64_t ld,
                        int64_t n, float* __restrict out) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    s0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + i), s0);
    s1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + ld + i), s1);
    s2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 2 * ld + i), s2);
    s3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 3 * ld + i), s3);
  }
  float t0 = 0, t1 = 0, t2 = 0, t3 = 0;
  for (; i < n; ++i) {
    t0 += x[i] * w[i];
    t1 += x[i] * w[ld + i];
    t2 += x[i] * w[2 * ld + i];
    t3 += x[i] * w[3 * ld + i];
  }
  out[0] += hsum(s0) + t0;
  out[1] += hsum(s1) + t1;
  out[2] += hsum(s2) + t2;
  out[3] += hsum(s3) + t3;
}
#endif

struct Support {
  int64_t q;
  const int64_t* out_off;  // (q + 1,)
  const int64_t* in_off;   // (q + 1,)
  const int64_t* blk_off;  // (q * q,)
  const uint8_t* uses;     // (types, q, q)
};

template <typename T>
void fused_rows_impl(const T* x, const T* packed, const int64_t* types, const Support& s,
                     const T* bias, bool four_rows, int64_t M, int64_t N, int64_t K, T* y) {
  const int64_t q = s.q;
  // users[(d*q + b)*M + k]: the k-th row m whose type reads block (d, b)
  std::vector<int64_t> users(q * q * M), n_users(q * q, 0);
  for (int64_t d = 0; d < q; ++d) {
    for (int64_t b = 0; b < q; ++b) {
      for (int64_t m = 0; m < M; ++m) {
        if (s.uses[(types[m] * q + d) * q + b]) {
          users[(d * q + b) * M + n_users[d * q + b]++] = m;
        }
      }
    }
  }
  const int64_t n_threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (N + kChunkRows - 1) / kChunkRows));
  at::parallel_for(0, n_threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> acc(M * kChunkRows);
    for (int64_t t = t0; t < t1; ++t) {
      // output rows [c0, c1) of one group: all the blocks they use, then y
      auto process = [&](int64_t c0, int64_t c1) {
        std::fill(acc.begin(), acc.end(), T(0));
        for (int64_t d = 0; d < q; ++d) {
          const int64_t lo = std::max(c0, s.out_off[d]), hi = std::min(c1, s.out_off[d + 1]);
          if (lo >= hi) continue;
          for (int64_t b = 0; b < q; ++b) {
            const int64_t count = n_users[d * q + b];
            if (count == 0) continue;
            const int64_t* rows = users.data() + (d * q + b) * M;
            const int64_t width = s.in_off[b + 1] - s.in_off[b];
            const T* blk = packed + s.blk_off[d * q + b] + (lo - s.out_off[d]) * width;
            int64_t n = lo;
            // Long dense rows: four at a time (each x vector loaded once for four).
            // Blocks (short rows, stored back to back) go one row at a time below, so
            // the reads form one forward stream: four at once would be four streams of
            // a few cache lines each, too short for the prefetchers (measured: 1.5x
            // slower).
            if (four_rows) {
              for (; n + 4 <= hi; n += 4, blk += 4 * width) {
                for (int64_t k = 0; k < count; ++k) {
                  const int64_t m = rows[k];
                  dot4<T>(x + m * K + s.in_off[b], blk, width, width,
                          acc.data() + m * kChunkRows + (n - c0));
                }
              }
            }
            for (; n < hi; ++n, blk += width) {
              for (int64_t k = 0; k < count; ++k) {
                const int64_t m = rows[k];
                acc[m * kChunkRows + (n - c0)] += dot1<T>(x + m * K + s.in_off[b], blk, width);
              }
            }
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t n = c0; n < c1; ++n) {
            y[m * N + n] = acc[m * kChunkRows + (n - c0)] + (bias ? bias[n] : T(0));
          }
        }
      };
      // Thread t takes the t-th slice of every output group: every row of a group uses
      // the same blocks, so the threads get equal work whatever the types.
      for (int64_t g = 0; g < q; ++g) {
        const int64_t rows_g = s.out_off[g + 1] - s.out_off[g];
        const int64_t g0 = s.out_off[g] + t * rows_g / n_threads;
        const int64_t g1 = s.out_off[g] + (t + 1) * rows_g / n_threads;
        for (int64_t c0 = g0; c0 < g1; c0 += kChunkRows) {
          process(c0, std::min(g1, c0 + kChunkRows));
        }
      }
    }
  });
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w,
                const c10::optional<torch::Tensor>& bias, int64_t N, int64_t K) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "fused_rows: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "fused_rows: x (M, ", K, ") expected, got ",
              x.sizes());
  TORCH_CHECK(w.is_contiguous() && w.numel() == N * K, "fused_rows: a contiguous weight of ",
              N * K, " elements expected, got ", w.numel());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "fused_rows: dtype mismatch: x is ",
              x.scalar_type(), ", the weight ", w.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N &&
                    bias->scalar_type() == x.scalar_type() && bias->device().is_cpu(),
                "fused_rows: a contiguous CPU bias of ", N, " elements and dtype ",
                x.scalar_type(), " expected");
  }
}

torch::Tensor run(torch::Tensor x, const torch::Tensor& w, const int64_t* types,
                  const Support& s, const c10::optional<torch::Tensor>& bias, bool four_rows,
                  int64_t N) {
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_rows_forward", [&] {
    fused_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), types, s,
                              bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr,
                              four_rows, M, N, K, y.data_ptr<scalar_t>());
  });
  return y;
}

}  // namespace

// x (M, K); packed: the weight (N, K) stored block by block (block (d, b) = rows of
// output group d, columns of input group b, row-major, at packed[blk_off[d*q + b]]);
// types (M,) int64 in [0, q); out_off / in_off (q + 1,) int64 group offsets; uses
// (q, q, q) uint8: uses[a][d][b] = type a reads block (d, b); bias (N,) or None.
// Returns y (M, N).
torch::Tensor fused_rows_forward(torch::Tensor x, torch::Tensor packed, torch::Tensor types,
                                 torch::Tensor out_off, torch::Tensor in_off,
                                 torch::Tensor blk_off, torch::Tensor uses, int64_t q,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(in_off.numel() == q + 1 && out_off.numel() == q + 1,
              "fused_rows: q + 1 group offsets expected");
  TORCH_CHECK(out_off.is_contiguous() && in_off.is_contiguous() && blk_off.is_contiguous() &&
                  uses.is_contiguous(),
              "fused_rows: contiguous tables expected");
  TORCH_CHECK(uses.scalar_type() == at::kByte && uses.numel() % (q * q) == 0,
              "fused_rows: a uint8 (types, q, q) block-use table expected");
  const int64_t N = out_off.data_ptr<int64_t>()[q];
  const int64_t K = in_off.data_ptr<int64_t>()[q];
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "fused_rows: x has ", x.sizes(),
              " but the layer's input groups cover ", K, " columns");
  check_rows(x, packed, bias, N, K);
  TORCH_CHECK(types.scalar_type() == at::kLong && types.numel() == x.size(0),
              "fused_rows: one int64 type per row expected");
  types = types.contiguous();
  const Support s{q, out_off.data_ptr<int64_t>(), in_off.data_ptr<int64_t>(),
                  blk_off.data_ptr<int64_t>(), uses.data_ptr<uint8_t>()};
  return run(x, packed, types.data_ptr<int64_t>(), s, bias, /*four_rows=*/q == 1, N);
}

// Dense y = x W^T (+ bias) for a few rows, W (N, K) row-major: the same loop with one
// group and one block.
torch::Tensor dense_rows_forward(torch::Tensor x, torch::Tensor w,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2, "dense_rows: weight (N, K) expected, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  check_rows(x, w, bias, N, K);
  const int64_t out_off[2] = {0, N}, in_off[2] = {0, K}, blk_off[1] = {0};
  const uint8_t uses[1] = {1};
  std::vector<int64_t> types(x.size(0), 0);
  const Support s{1, out_off, in_off, blk_off, uses};
  return run(x, w, types.data(), s, bias, /*four_rows=*/true, N);
}

// Decode SwiGLU FFN in one call: down(silu(gate(x)) * up(x)), each projection the
// support-driven loop above (gate and up share the tables `gu_*`, down has `dn_*`; a
// dense FFN passes the trivial one-group tables, so both run the same code).
torch::Tensor swiglu_rows_forward(torch::Tensor x, torch::Tensor gate, torch::Tensor up,
                                  torch::Tensor down, torch::Tensor types,
                                  torch::Tensor gu_out_off, torch::Tensor gu_in_off,
                                  torch::Tensor gu_blk_off, torch::Tensor gu_uses,
                                  torch::Tensor dn_out_off, torch::Tensor dn_in_off,
                                  torch::Tensor dn_blk_off, torch::Tensor dn_uses, int64_t q) {
  const c10::optional<torch::Tensor> none;
  auto g = fused_rows_forward(x, gate, types, gu_out_off, gu_in_off, gu_blk_off, gu_uses, q,
                              none);
  auto u = fused_rows_forward(x, up, types, gu_out_off, gu_in_off, gu_blk_off, gu_uses, q,
                              none);
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "swiglu_rows_forward", [&] {
    scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* up_ = u.data_ptr<scalar_t>();
    const int64_t n = g.numel();
    for (int64_t i = 0; i < n; ++i) {
      const scalar_t v = gp[i];
      gp[i] = v / (scalar_t(1) + std::exp(-v)) * up_[i];
    }
  });
  return fused_rows_forward(g, down, types, dn_out_off, dn_in_off, dn_blk_off, dn_uses, q, none);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu_rows_forward", &swiglu_rows_forward,
        "down(silu(gate(x)) * up(x)) for a few rows, each projection support-driven");
  m.def("fused_rows_forward", &fused_rows_forward,
        "y = x W_eff(type)^T (+ bias) for a few rows, reading only the support's weight blocks");
  m.def("dense_rows_forward", &dense_rows_forward, "y = x W^T (+ bias) for a few rows");
}
