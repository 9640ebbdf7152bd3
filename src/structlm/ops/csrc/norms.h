// Row normalisations of the decode steps (moments in double).
#pragma once

#include <cmath>
#include <cstdint>

namespace structlm {

// y = (x - mean) / sqrt(var + eps) * w (+ b) over rows of width d (b may be null).
template <typename T>
void layer_norm_rows(const T* x, const T* w, const T* b, double eps, int64_t rows, int64_t d,
                     T* y) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * d;
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < d; ++i) mean += xr[i];
    mean /= static_cast<double>(d);
    for (int64_t i = 0; i < d; ++i) {
      const double c = xr[i] - mean;
      var += c * c;
    }
    const double inv = 1.0 / std::sqrt(var / static_cast<double>(d) + eps);
    for (int64_t i = 0; i < d; ++i) {
      y[m * d + i] = static_cast<T>((xr[i] - mean) * inv) * w[i] + (b ? b[i] : T(0));
    }
  }
}

// y = x / sqrt(mean(x^2) + eps) * w over rows of width d (HF's RMSNorm); y may be x.
template <typename T>
void rms_norm_rows(const T* x, const T* w, double eps, int64_t rows, int64_t d, T* y) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* xr = x + m * d;
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const T inv = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
    for (int64_t i = 0; i < d; ++i) y[m * d + i] = w[i] * (xr[i] * inv);
  }
}

}  // namespace structlm
