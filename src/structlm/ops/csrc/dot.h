// Dot products for the decode kernels: x . w over n elements, and four weight rows
// against one x (the typed-copy loop; the block-packed one is panel.h). AVX2/FMA for float where the compiler targets it, else a portable
// 32-lane loop GCC vectorises (and double).
#pragma once

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STRUCTLM_AVX2 1
#endif

namespace structlm {

constexpr int64_t kLanes = 32;  // independent partial sums in the portable dot

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

// x . w where the row w is segments of x back to back: segment g is x[off[g] : off[g] +
// width[g]] (a typed row: the blocks its type reads, read from x in place).
template <typename T>
inline T dot_segments(const T* __restrict x, const int64_t* off, const int64_t* width,
                      int64_t n_seg, const T* __restrict w) {
  T s = 0;
  for (int64_t g = 0; g < n_seg; w += width[g++]) s += dot_segment(x + off[g], w, width[g]);
  return s;
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

// One AVX2 accumulation pass: adds x[i] * w[i] for i < n into the four vector partial
// sums (32, then 8 lanes at a time) and the scalar tail into t.
struct Acc8x4 {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
         s3 = _mm256_setzero_ps();
  float t = 0;

  inline void add(const float* __restrict x, const float* __restrict w, int64_t n) {
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
    for (; i < n; ++i) t += x[i] * w[i];
  }

  inline float sum() const {
    return hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3))) + t;
  }
};

template <>
inline float dot1<float>(const float* __restrict x, const float* __restrict w, int64_t n) {
  Acc8x4 acc;
  acc.add(x, w, n);
  return acc.sum();
}

// The segments' products summed in one set of accumulators (one reduction per row).
template <>
inline float dot_segments<float>(const float* __restrict x, const int64_t* off,
                                 const int64_t* width, int64_t n_seg,
                                 const float* __restrict w) {
  Acc8x4 acc;
  for (int64_t g = 0; g < n_seg; w += width[g++]) acc.add(x + off[g], w, width[g]);
  return acc.sum();
}

// Four weight rows against one x: each x vector is loaded once for four FMAs. (A software
// prefetch of the next four rows, one line per row per 16 floats, was 0-8% slower on an
// AMD EPYC VM, weights rotated over 1 GiB, builds alternated three times: the hardware
// prefetchers already follow these streams.)
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

}  // namespace structlm
