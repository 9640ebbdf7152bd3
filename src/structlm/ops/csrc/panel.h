// Panel products for the block-packed few-row kernel: up to four input rows against one
// panel of a weight block, the panel stored input-major (element (k, j) of a panel of
// `pw` output rows at k * pw + j), so each input value is broadcast against `pw`
// contiguous weights and the outputs stay in vector accumulators: no horizontal sum per
// output and block, and each weight vector loaded once for all the rows. AVX2/FMA for
// full float panels where the compiler targets it; a portable loop otherwise (double,
// the last, narrower panel of a block).
#pragma once

#include <cstdint>

#include "dot.h"  // STRUCTLM_AVX2

namespace structlm {

constexpr int64_t kPanel = 16;  // output rows of a full panel

// acc[u][j] += sum_k x[u][k] * pan[k * pw + j] for u < n_rows, j < pw.
template <typename T>
inline void panel_rows_generic(const T* const* __restrict x, int64_t n_rows,
                               const T* __restrict pan, int64_t w, int64_t pw,
                               T* const* __restrict acc) {
  for (int64_t u = 0; u < n_rows; ++u) {
    T* a = acc[u];
    const T* xu = x[u];
    for (int64_t k = 0; k < w; ++k) {
      const T xv = xu[k];
      const T* p = pan + k * pw;
      for (int64_t j = 0; j < pw; ++j) a[j] += xv * p[j];
    }
  }
}

// The same for a full panel (pw = kPanel) and up to four rows.
template <typename T>
inline void panel_rows(const T* const* x, int64_t n_rows, const T* pan, int64_t w,
                       T* const* acc) {
  panel_rows_generic<T>(x, n_rows, pan, w, kPanel, acc);
}

#ifdef STRUCTLM_AVX2
// U rows, the k loop split S ways (independent accumulators: with one or two rows a single
// chain per output vector would wait on the FMA latency).
template <int U, int S>
inline void panel_rows_avx2(const float* const* __restrict x, const float* __restrict pan,
                            int64_t w, float* const* __restrict acc) {
  __m256 a[S][U][2];
  for (int s = 0; s < S; ++s) {
    for (int u = 0; u < U; ++u) {
      a[s][u][0] = s == 0 ? _mm256_loadu_ps(acc[u]) : _mm256_setzero_ps();
      a[s][u][1] = s == 0 ? _mm256_loadu_ps(acc[u] + 8) : _mm256_setzero_ps();
    }
  }
  int64_t k = 0;
  for (; k + S <= w; k += S) {
    for (int s = 0; s < S; ++s) {
      const float* p = pan + (k + s) * kPanel;
      const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
      for (int u = 0; u < U; ++u) {
        const __m256 xb = _mm256_broadcast_ss(x[u] + k + s);
        a[s][u][0] = _mm256_fmadd_ps(xb, w0, a[s][u][0]);
        a[s][u][1] = _mm256_fmadd_ps(xb, w1, a[s][u][1]);
      }
    }
  }
  for (; k < w; ++k) {  // the k left over by the split
    const float* p = pan + k * kPanel;
    const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
    for (int u = 0; u < U; ++u) {
      const __m256 xb = _mm256_broadcast_ss(x[u] + k);
      a[0][u][0] = _mm256_fmadd_ps(xb, w0, a[0][u][0]);
      a[0][u][1] = _mm256_fmadd_ps(xb, w1, a[0][u][1]);
    }
  }
  for (int u = 0; u < U; ++u) {
    __m256 lo = a[0][u][0], hi = a[0][u][1];
    for (int s = 1; s < S; ++s) {
      lo = _mm256_add_ps(lo, a[s][u][0]);
      hi = _mm256_add_ps(hi, a[s][u][1]);
    }
    _mm256_storeu_ps(acc[u], lo);
    _mm256_storeu_ps(acc[u] + 8, hi);
  }
}

template <>
inline void panel_rows<float>(const float* const* x, int64_t n_rows, const float* pan,
                              int64_t w, float* const* acc) {
  switch (n_rows) {
    case 1: panel_rows_avx2<1, 4>(x, pan, w, acc); break;
    case 2: panel_rows_avx2<2, 2>(x, pan, w, acc); break;
    case 3: panel_rows_avx2<3, 1>(x, pan, w, acc); break;
    default: panel_rows_avx2<4, 1>(x, pan, w, acc); break;
  }
}
#endif

}  // namespace structlm
