// Panel products for the block-packed few-row kernel: up to kPanelRowsPerCall input rows
// (four; eight with AVX-512) against one
// panel of a weight block, the panel stored input-major (element (k, j) of a panel of
// `pw` output rows at k * pw + j), so each input value is broadcast against `pw`
// contiguous weights and the outputs stay in vector accumulators: no horizontal sum per
// output and block, and each weight vector loaded once for all the rows. AVX2/FMA for
// full float panels where the compiler targets it; a portable loop otherwise (double,
// the last, narrower panel of a block).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "dot.h"  // STRUCTLM_AVX2

namespace structlm {

constexpr int64_t kPanel = 16;  // output rows of a full panel

#if defined(STRUCTLM_AVX2) && defined(__AVX512F__)
#define STRUCTLM_AVX512 1
constexpr int64_t kPanelRowsPerCall = 8;  // rows per panel_rows call (AVX-512: 5-8 at once)
constexpr bool kPairedPanels = true;      // panel_pair_rows: two strips, six rows at once
#else
constexpr int64_t kPanelRowsPerCall = 4;
constexpr bool kPairedPanels = false;
#endif
constexpr int64_t kPairRows = 6;  // rows per panel_pair_rows call
// A dense weight (one group) at up to this many rows: the first pair call of each strip
// pair prefetches the next pair's panels. 4096x4096, 2 threads, weights rotated, builds
// alternated (benchmarks/few_row_rotated.py, benchmarks/results/few_row_rotated_prefetch.md):
// M = 16 3.72-4.15 -> 3.40-3.46 ms, M = 8 0-7% faster, the rest unchanged. With the limit
// at 32 (one earlier build), M = 32 and the algebra layers' mixed-type rows (Q2^2 at
// M = 32, Q4 at M = 64) came out 2-6% slower, so neither takes it.
constexpr int64_t kPrefetchMaxRows = 16;

#ifndef STRUCTLM_AVX512
// Never called without AVX-512 (kPairedPanels is false): declared so the paired branch
// compiles everywhere, and a trap should a caller's gate ever drift from kPairedPanels.
inline void panel_pair_rows(const float* const*, const float*, const float*, int64_t,
                            float* const*, float* const*, const float* = nullptr) {
  std::abort();
}
inline void panel_pair_rows_rest(const float* const*, int64_t, const float*, const float*,
                                 int64_t, float* const*, float* const*) {
  std::abort();
}
inline void panel_segments(const float* const*, int64_t, const int64_t*, const int64_t*,
                           const float* const*, int64_t, std::ptrdiff_t, float* const*,
                           const float*, int) {
  std::abort();
}
#endif

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

// The same for a full panel (pw = kPanel) and up to kPanelRowsPerCall rows.
template <typename T>
inline void panel_rows(const T* const* x, int64_t n_rows, const T* pan, int64_t w,
                       T* const* acc) {
  panel_rows_generic<T>(x, n_rows, pan, w, kPanel, acc);
}

#ifdef STRUCTLM_AVX2
// The accumulators are named variables, not an array: GCC kept an array of __m256 in
// memory (a store per FMA and the weight reloaded for every row: 3.5x slower).
#define STRUCTLM_PANEL_FMA(lo, hi, xp, kk, w0, w1)            \
  do {                                                         \
    const __m256 xb_ = _mm256_broadcast_ss((xp) + (kk));       \
    lo = _mm256_fmadd_ps(xb_, w0, lo);                         \
    hi = _mm256_fmadd_ps(xb_, w1, hi);                         \
  } while (0)

// Rows 0..n_rows-1 (n_rows 3 or 4; a 3-row call passes row 2 again as row 3 and keeps
// its own result), one chain per output vector.
inline void panel_rows34_avx2(const float* const* __restrict x, int64_t n_rows,
                              const float* __restrict pan, int64_t w,
                              float* const* __restrict acc) {
  const float* x0 = x[0];
  const float* x1 = x[1];
  const float* x2 = x[2];
  const float* x3 = n_rows > 3 ? x[3] : x[2];
  __m256 a0 = _mm256_loadu_ps(acc[0]), b0 = _mm256_loadu_ps(acc[0] + 8);
  __m256 a1 = _mm256_loadu_ps(acc[1]), b1 = _mm256_loadu_ps(acc[1] + 8);
  __m256 a2 = _mm256_loadu_ps(acc[2]), b2 = _mm256_loadu_ps(acc[2] + 8);
  __m256 a3 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  if (n_rows > 3) a3 = _mm256_loadu_ps(acc[3]), b3 = _mm256_loadu_ps(acc[3] + 8);
  for (int64_t k = 0; k < w; ++k) {
    const __m256 w0 = _mm256_loadu_ps(pan + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(pan + k * kPanel + 8);
    STRUCTLM_PANEL_FMA(a0, b0, x0, k, w0, w1);
    STRUCTLM_PANEL_FMA(a1, b1, x1, k, w0, w1);
    STRUCTLM_PANEL_FMA(a2, b2, x2, k, w0, w1);
    STRUCTLM_PANEL_FMA(a3, b3, x3, k, w0, w1);
  }
  _mm256_storeu_ps(acc[0], a0), _mm256_storeu_ps(acc[0] + 8, b0);
  _mm256_storeu_ps(acc[1], a1), _mm256_storeu_ps(acc[1] + 8, b1);
  _mm256_storeu_ps(acc[2], a2), _mm256_storeu_ps(acc[2] + 8, b2);
  if (n_rows > 3) _mm256_storeu_ps(acc[3], a3), _mm256_storeu_ps(acc[3] + 8, b3);
}

// One or two rows, the k loop split in two (independent chains: a single chain per
// output vector would wait on the FMA latency).
inline void panel_rows12_avx2(const float* const* __restrict x, int64_t n_rows,
                              const float* __restrict pan, int64_t w,
                              float* const* __restrict acc) {
  const float* x0 = x[0];
  const float* x1 = n_rows > 1 ? x[1] : x[0];
  __m256 a0 = _mm256_loadu_ps(acc[0]), b0 = _mm256_loadu_ps(acc[0] + 8);
  __m256 a1 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  if (n_rows > 1) a1 = _mm256_loadu_ps(acc[1]), b1 = _mm256_loadu_ps(acc[1] + 8);
  __m256 c0 = _mm256_setzero_ps(), d0 = c0, c1 = c0, d1 = c0;  // odd k
  int64_t k = 0;
  for (; k + 2 <= w; k += 2) {
    const float* p = pan + k * kPanel;
    const __m256 w0 = _mm256_loadu_ps(p), w1 = _mm256_loadu_ps(p + 8);
    const __m256 v0 = _mm256_loadu_ps(p + kPanel), v1 = _mm256_loadu_ps(p + kPanel + 8);
    STRUCTLM_PANEL_FMA(a0, b0, x0, k, w0, w1);
    STRUCTLM_PANEL_FMA(a1, b1, x1, k, w0, w1);
    STRUCTLM_PANEL_FMA(c0, d0, x0, k + 1, v0, v1);
    STRUCTLM_PANEL_FMA(c1, d1, x1, k + 1, v0, v1);
  }
  if (k < w) {
    const __m256 w0 = _mm256_loadu_ps(pan + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(pan + k * kPanel + 8);
    STRUCTLM_PANEL_FMA(a0, b0, x0, k, w0, w1);
    STRUCTLM_PANEL_FMA(a1, b1, x1, k, w0, w1);
  }
  _mm256_storeu_ps(acc[0], _mm256_add_ps(a0, c0));
  _mm256_storeu_ps(acc[0] + 8, _mm256_add_ps(b0, d0));
  if (n_rows > 1) {
    _mm256_storeu_ps(acc[1], _mm256_add_ps(a1, c1));
    _mm256_storeu_ps(acc[1] + 8, _mm256_add_ps(b1, d1));
  }
}
#undef STRUCTLM_PANEL_FMA

#ifdef STRUCTLM_AVX512
// Five to eight rows against a full panel: the panel's 16 outputs are one zmm, one
// accumulator per row, so each k is one weight load and eight broadcast FMAs (eight
// independent chains cover the FMA latency). Rows past n_rows repeat row 4's input and
// are not stored.
#define STRUCTLM_ROW_FMA(a, xp, kk, wv) a = _mm512_fmadd_ps(_mm512_set1_ps((xp)[kk]), wv, a)
inline void panel_rows58_avx512(const float* const* __restrict x, int64_t n_rows,
                                const float* __restrict pan, int64_t w,
                                float* const* __restrict acc) {
  const float* x0 = x[0];
  const float* x1 = x[1];
  const float* x2 = x[2];
  const float* x3 = x[3];
  const float* x4 = x[4];
  const float* x5 = n_rows > 5 ? x[5] : x4;
  const float* x6 = n_rows > 6 ? x[6] : x4;
  const float* x7 = n_rows > 7 ? x[7] : x4;
  const __m512 z = _mm512_setzero_ps();
  __m512 a0 = _mm512_loadu_ps(acc[0]), a1 = _mm512_loadu_ps(acc[1]);
  __m512 a2 = _mm512_loadu_ps(acc[2]), a3 = _mm512_loadu_ps(acc[3]);
  __m512 a4 = _mm512_loadu_ps(acc[4]);
  __m512 a5 = n_rows > 5 ? _mm512_loadu_ps(acc[5]) : z;
  __m512 a6 = n_rows > 6 ? _mm512_loadu_ps(acc[6]) : z;
  __m512 a7 = n_rows > 7 ? _mm512_loadu_ps(acc[7]) : z;
  for (int64_t k = 0; k < w; ++k) {
    const __m512 wv = _mm512_loadu_ps(pan + k * kPanel);
    STRUCTLM_ROW_FMA(a0, x0, k, wv);
    STRUCTLM_ROW_FMA(a1, x1, k, wv);
    STRUCTLM_ROW_FMA(a2, x2, k, wv);
    STRUCTLM_ROW_FMA(a3, x3, k, wv);
    STRUCTLM_ROW_FMA(a4, x4, k, wv);
    STRUCTLM_ROW_FMA(a5, x5, k, wv);
    STRUCTLM_ROW_FMA(a6, x6, k, wv);
    STRUCTLM_ROW_FMA(a7, x7, k, wv);
  }
  _mm512_storeu_ps(acc[0], a0), _mm512_storeu_ps(acc[1], a1);
  _mm512_storeu_ps(acc[2], a2), _mm512_storeu_ps(acc[3], a3);
  _mm512_storeu_ps(acc[4], a4);
  if (n_rows > 5) _mm512_storeu_ps(acc[5], a5);
  if (n_rows > 6) _mm512_storeu_ps(acc[6], a6);
  if (n_rows > 7) _mm512_storeu_ps(acc[7], a7);
}
#undef STRUCTLM_ROW_FMA

// Six rows against two full panels (32 outputs) at once: each input value is broadcast
// into a register once and multiplied into both panels' weight vectors, so a k costs two
// weight loads and six broadcasts for twelve FMAs (the one-panel call: one load and eight
// broadcasts for eight). Measured alone, hot in cache, one thread: 57 -> 74 GMAC/s.
// `next` (optional): the next strip pair's first panel at the same input offset (its
// second lies as far beyond it as pan1 beyond pan0); its lines are prefetched into L2
// while this pair computes, so the DRAM read of the next strip overlaps this one's
// arithmetic.
#define STRUCTLM_PAIR_FMA(i)                                     \
  do {                                                           \
    const __m512 xb_ = _mm512_set1_ps(x##i[k]);                  \
    a##i = _mm512_fmadd_ps(xb_, w0, a##i);                       \
    c##i = _mm512_fmadd_ps(xb_, w1, c##i);                       \
  } while (0)
inline void panel_pair_rows(const float* const* __restrict x, const float* __restrict pan0,
                            const float* __restrict pan1, int64_t w,
                            float* const* __restrict acc0, float* const* __restrict acc1,
                            const float* next = nullptr) {
  const std::ptrdiff_t gap = pan1 - pan0;  // the second panel of a pair, as in this one
  const float* x0 = x[0];
  const float* x1 = x[1];
  const float* x2 = x[2];
  const float* x3 = x[3];
  const float* x4 = x[4];
  const float* x5 = x[5];
  __m512 a0 = _mm512_loadu_ps(acc0[0]), a1 = _mm512_loadu_ps(acc0[1]);
  __m512 a2 = _mm512_loadu_ps(acc0[2]), a3 = _mm512_loadu_ps(acc0[3]);
  __m512 a4 = _mm512_loadu_ps(acc0[4]), a5 = _mm512_loadu_ps(acc0[5]);
  __m512 c0 = _mm512_loadu_ps(acc1[0]), c1 = _mm512_loadu_ps(acc1[1]);
  __m512 c2 = _mm512_loadu_ps(acc1[2]), c3 = _mm512_loadu_ps(acc1[3]);
  __m512 c4 = _mm512_loadu_ps(acc1[4]), c5 = _mm512_loadu_ps(acc1[5]);
  for (int64_t k = 0; k < w; ++k) {
    if (next != nullptr) {  // loop-invariant: the compiler keeps two loops
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + gap + k * kPanel), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(pan0 + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(pan1 + k * kPanel);
    STRUCTLM_PAIR_FMA(0);
    STRUCTLM_PAIR_FMA(1);
    STRUCTLM_PAIR_FMA(2);
    STRUCTLM_PAIR_FMA(3);
    STRUCTLM_PAIR_FMA(4);
    STRUCTLM_PAIR_FMA(5);
  }
  _mm512_storeu_ps(acc0[0], a0), _mm512_storeu_ps(acc0[1], a1);
  _mm512_storeu_ps(acc0[2], a2), _mm512_storeu_ps(acc0[3], a3);
  _mm512_storeu_ps(acc0[4], a4), _mm512_storeu_ps(acc0[5], a5);
  _mm512_storeu_ps(acc1[0], c0), _mm512_storeu_ps(acc1[1], c1);
  _mm512_storeu_ps(acc1[2], c2), _mm512_storeu_ps(acc1[3], c3);
  _mm512_storeu_ps(acc1[4], c4), _mm512_storeu_ps(acc1[5], c5);
}
#undef STRUCTLM_PAIR_FMA

// One to five rows against two full panels (the rest of a block's rows after the
// six-row pair calls): each input value broadcast once for both panels' weight vectors,
// R x 2 accumulators (for R <= 3 the k loop split in two, so at least eight independent
// chains cover the FMA latency). The arrays are indexed by constants only and the loops
// over them fully unrolled, so the accumulators stay in registers.
template <int R>
inline void panel_pair_rows_few(const float* const* __restrict x, const float* __restrict pan0,
                                const float* __restrict pan1, int64_t w,
                                float* const* __restrict acc0, float* const* __restrict acc1) {
  static_assert(R >= 1 && R <= 5, "one to five rows");
  constexpr bool kSplit = R <= 3;
  const __m512 z = _mm512_setzero_ps();
  __m512 a[R], c[R], e[R], f[R];  // e, f: odd k where split
  const float* xr[R];
#pragma GCC unroll 5
  for (int r = 0; r < R; ++r) {
    xr[r] = x[r];
    a[r] = _mm512_loadu_ps(acc0[r]);
    c[r] = _mm512_loadu_ps(acc1[r]);
    e[r] = z;
    f[r] = z;
  }
  int64_t k = 0;
  if constexpr (kSplit) {
    for (; k + 2 <= w; k += 2) {
      const __m512 w0 = _mm512_loadu_ps(pan0 + k * kPanel);
      const __m512 w1 = _mm512_loadu_ps(pan1 + k * kPanel);
      const __m512 v0 = _mm512_loadu_ps(pan0 + (k + 1) * kPanel);
      const __m512 v1 = _mm512_loadu_ps(pan1 + (k + 1) * kPanel);
#pragma GCC unroll 5
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xr[r][k]);
        const __m512 xo = _mm512_set1_ps(xr[r][k + 1]);
        a[r] = _mm512_fmadd_ps(xb, w0, a[r]);
        c[r] = _mm512_fmadd_ps(xb, w1, c[r]);
        e[r] = _mm512_fmadd_ps(xo, v0, e[r]);
        f[r] = _mm512_fmadd_ps(xo, v1, f[r]);
      }
    }
  }
  for (; k < w; ++k) {
    const __m512 w0 = _mm512_loadu_ps(pan0 + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(pan1 + k * kPanel);
#pragma GCC unroll 5
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xr[r][k]);
      a[r] = _mm512_fmadd_ps(xb, w0, a[r]);
      c[r] = _mm512_fmadd_ps(xb, w1, c[r]);
    }
  }
#pragma GCC unroll 5
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc0[r], _mm512_add_ps(a[r], e[r]));
    _mm512_storeu_ps(acc1[r], _mm512_add_ps(c[r], f[r]));
  }
}

// R rows (1 to 6) against S full panels (2 or 4: one or two strip pairs) over n_seg input
// segments -- segment s is inputs x[r] + off[s] .. + width[s], its panels at pan[s] + j gap
// for j < S -- with the R x S accumulators in registers from zero to the end (24 of the 32
// zmm at S = 4): stored once, plus the bias where given, straight into the rows' outputs
// (y[r] .. y[r] + S kPanel). No accumulator memory to fill, reload per block or copy out:
// the many-rows layout of fused_rows_impl.
template <int R, int S>
inline void panel_segments_rows(const float* const* __restrict x, const int64_t* off,
                                const int64_t* width, const float* const* pan, int64_t n_seg,
                                std::ptrdiff_t gap, float* const* __restrict y,
                                const float* bias) {
  static_assert(R >= 1 && R <= 6 && (S == 2 || S == 4), "one to six rows, 2 or 4 strips");
  __m512 a[S][R];
#pragma GCC unroll 4
  for (int j = 0; j < S; ++j) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) a[j][r] = _mm512_setzero_ps();
  }
  for (int64_t sg = 0; sg < n_seg; ++sg) {
    const float* __restrict p0 = pan[sg];
    const float* xr[R];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) xr[r] = x[r] + off[sg];
    for (int64_t k = 0, w = width[sg]; k < w; ++k) {
      __m512 wv[S];
#pragma GCC unroll 4
      for (int j = 0; j < S; ++j) wv[j] = _mm512_loadu_ps(p0 + j * gap + k * kPanel);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xr[r][k]);
#pragma GCC unroll 4
        for (int j = 0; j < S; ++j) a[j][r] = _mm512_fmadd_ps(xb, wv[j], a[j][r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < S; ++j) {
    const __m512 bj = bias ? _mm512_loadu_ps(bias + j * kPanel) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y[r] + j * kPanel, _mm512_add_ps(a[j][r], bj));
  }
}

// panel_segments_rows for n_rows in [1, 6] and `strips` 2 or 4 (two strip pairs).
inline void panel_segments(const float* const* x, int64_t n_rows, const int64_t* off,
                           const int64_t* width, const float* const* pan, int64_t n_seg,
                           std::ptrdiff_t gap, float* const* y, const float* bias, int strips) {
#define STRUCTLM_SEGMENTS_CASE(R)                                          \
  case R:                                                                  \
    if (strips == 4) {                                                     \
      panel_segments_rows<R, 4>(x, off, width, pan, n_seg, gap, y, bias); \
    } else {                                                               \
      panel_segments_rows<R, 2>(x, off, width, pan, n_seg, gap, y, bias); \
    }                                                                      \
    break;
  switch (n_rows) {
    STRUCTLM_SEGMENTS_CASE(1)
    STRUCTLM_SEGMENTS_CASE(2)
    STRUCTLM_SEGMENTS_CASE(3)
    STRUCTLM_SEGMENTS_CASE(4)
    STRUCTLM_SEGMENTS_CASE(5)
    STRUCTLM_SEGMENTS_CASE(6)
    default: break;  // never called with another count (fused_rows_impl: 1 to 6)
  }
#undef STRUCTLM_SEGMENTS_CASE
}

// panel_pair_rows_few for n_rows in [1, 5].
inline void panel_pair_rows_rest(const float* const* x, int64_t n_rows, const float* pan0,
                                 const float* pan1, int64_t w, float* const* acc0,
                                 float* const* acc1) {
  switch (n_rows) {
    case 1: panel_pair_rows_few<1>(x, pan0, pan1, w, acc0, acc1); break;
    case 2: panel_pair_rows_few<2>(x, pan0, pan1, w, acc0, acc1); break;
    case 3: panel_pair_rows_few<3>(x, pan0, pan1, w, acc0, acc1); break;
    case 4: panel_pair_rows_few<4>(x, pan0, pan1, w, acc0, acc1); break;
    case 5: panel_pair_rows_few<5>(x, pan0, pan1, w, acc0, acc1); break;
    default: break;  // never called with another count (fused_rows_impl: 1 to 5)
  }
}
#endif

template <>
inline void panel_rows<float>(const float* const* x, int64_t n_rows, const float* pan,
                              int64_t w, float* const* acc) {
#ifdef STRUCTLM_AVX512
  if (n_rows >= 5) {
    panel_rows58_avx512(x, n_rows, pan, w, acc);
    return;
  }
#endif
  if (n_rows >= 3) {
    panel_rows34_avx2(x, n_rows, pan, w, acc);
  } else {
    panel_rows12_avx2(x, n_rows, pan, w, acc);
  }
}
#endif

}  // namespace structlm
