// One-call CPU kernels (cached decode, and inference batches of any size): y[m, n] = sum
// over the input groups b that row m's type uses for output group(n) of x[m, group b] .
// W[n, group b] (+ bias[n]), reading exactly the support's weight, each weight row once
// per call and row block (kept in L1 for every row m that uses it). Two layouts of the
// weight:
//
// * typed (`typed_rows_forward`, every row of one type: a decode step): each type has
//   its own copy, whose rows hold just the blocks the type reads, concatenated, so the
//   type's weight is one contiguous stream cut into one range per thread -- exactly a
//   dense GEMV's access pattern. Costs the sum over types of their supports in memory
//   (2.25x the layer's weight for Q2^2) and is what the dense layers run too: a dense
//   weight is the q = 1 case, read in place (`dense_rows_forward`), so dense and algebra
//   layers are timed on one loop.
// * panel-packed (`fused_rows_forward`, rows of mixed types): strips of 16 output rows,
//   each stored transposed (input-major, panel.h), so a thread's reads are one forward
//   stream; the rows' types select the strips' block parts, each read once for all the
//   rows using it, their outputs accumulated in registers. +1x memory only. Many rows
//   go in row blocks (kRowBlock, rows sorted by type): a GEMM whose weight panels stay in
//   L1 and whose rows stay in L2, at MKL's rate on a dense weight (M = 2048, 4096^2,
//   AMD EPYC VM: 207 vs 195 GFLOP/s).
//
// A type's blocks read as 192-float pieces of row-major [out, in] rows cost as much memory
// traffic as the full rows (the prefetchers fetch the skipped lines too), hence the copies.
// Built with -fopenmp: without it ATen's parallel_for runs serially inside an extension
// (measured: 9 GB/s instead of 16 GB/s on 2 cores).
// The slow obvious version is structlm.ops.reference; tests compare the two.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "dot.h"
#include "panel.h"
#include "panel_rows.h"
#include "rows_kernel.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

using structlm::dot1;
using structlm::dot4;
using structlm::dot_segments;
using structlm::kPanel;

constexpr int64_t kChunkRows = 64;  // output rows per accumulator pass (measured: 16-256)
// typed rows at least this long go four at a time (each x vector loaded once for four
// rows), shorter ones one at a time (one forward stream). Weights rotated over 1 GiB, 2
// threads, builds alternated three times (AMD EPYC Zen 4 VM): one at a time is 1.2-1.7x
// faster on rows of 576 and 1536 floats (SmolLM2's projections; its 49152x576 LM head
// 3.7-3.9 -> 2.3-2.7 ms) and level on 4096-float rows; on the Xeon VM four at a time was
// 1.3x slower on 384-float rows and a few percent faster on 768-float ones.
constexpr int64_t kFourRowsMinLength = 2048;
using structlm::Support;
using structlm::fused_rows_impl;

// Row lengths of every type's copy: lengths[a * q + d] = the widths of the blocks (d, b)
// type a reads (one branch-free pass over the use table: O(types q^2) multiply-adds, a
// few microseconds for Q32's 32 x 32 x 32, where a branchy per-call walk cost ~20 us).
inline std::vector<int64_t> typed_row_lengths(const Support& s, int64_t n_types) {
  const int64_t q = s.q;
  std::vector<int64_t> width(q), lengths(n_types * q, 0);
  for (int64_t b = 0; b < q; ++b) width[b] = s.in_off[b + 1] - s.in_off[b];
  for (int64_t ad = 0; ad < n_types * q; ++ad) {
    const uint8_t* u = s.uses + ad * q;
    int64_t len = 0;
    for (int64_t b = 0; b < q; ++b) len += static_cast<int64_t>(u[b] != 0) * width[b];
    lengths[ad] = len;
  }
  return lengths;
}

// Elements of type a's copy: sum over output groups of rows x row length.
inline int64_t typed_copy_size(const Support& s, const int64_t* lengths_a) {
  int64_t n = 0;
  for (int64_t d = 0; d < s.q; ++d) n += (s.out_off[d + 1] - s.out_off[d]) * lengths_a[d];
  return n;
}

// Typed copy, every row of type `a`. The copies of types 0, 1, ... lie back to back;
// in type a's, output group d's rows have length len[d] (its blocks (d, b), ascending b);
// `typed` points at type a's copy.
template <typename T>
void typed_rows_impl(const T* x, const T* typed, int64_t a, const int64_t* len,
                     const Support& s, const T* bias, int64_t M, int64_t N, int64_t K, T* y) {
  const int64_t q = s.q;
  std::vector<int64_t> start(q + 1, 0);  // start: group d's offset in the copy
  for (int64_t d = 0; d < q; ++d) {
    start[d + 1] = start[d] + (s.out_off[d + 1] - s.out_off[d]) * len[d];
  }
  // Rows of fewer than kFourRowsMinLength inputs (one at a time) read x in place, as the
  // segments of the blocks their type reads. Longer rows (four at a time) read a gathered
  // copy, xg: row m's inputs for group d, the blocks' input columns concatenated like the
  // rows. (Gathering for short rows too cost Q2^2's SmolLM2 decode step a serial copy per
  // call into a buffer the weight stream keeps evicting, the other thread idle meanwhile.)
  bool long_rows = false;
  for (int64_t d = 0; d < q; ++d) long_rows = long_rows || len[d] >= kFourRowsMinLength;
  const bool gather = q > 1 && long_rows;
  int64_t xg_width = 0;
  std::vector<int64_t> xg_off(q);
  for (int64_t d = 0; d < q; ++d) xg_off[d] = xg_width, xg_width += len[d];
  std::vector<T> xg(gather ? M * xg_width : 0);
  if (gather) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t d = 0; d < q; ++d) {
        T* dst = xg.data() + m * xg_width + xg_off[d];
        for (int64_t b = 0; b < q; ++b) {
          if (!s.uses[(a * q + d) * q + b]) continue;
          dst = std::copy(x + m * K + s.in_off[b], x + m * K + s.in_off[b + 1], dst);
        }
      }
    }
  }
  const int64_t total = start[q];  // weight elements to read
  const int64_t n_threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (N + kChunkRows - 1) / kChunkRows));
  // the first output row at or after weight element e (threads get equal bytes)
  auto row_at = [&](int64_t e) {
    for (int64_t d = 0; d < q; ++d) {
      if (e < start[d + 1] && len[d] > 0) {
        return s.out_off[d] + std::max<int64_t>(0, e - start[d] + len[d] - 1) / len[d];
      }
    }
    return N;
  };
  at::parallel_for(0, n_threads, 1, [&](int64_t t0, int64_t t1) {
    // group d's segments of x, where its rows read x in place (typed, short rows)
    std::vector<int64_t> seg_off(gather || q == 1 ? 0 : q), seg_width(seg_off.size());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t == 0 ? 0 : row_at(t * total / n_threads);
      const int64_t r1 = t + 1 == n_threads ? N : row_at((t + 1) * total / n_threads);
      for (int64_t d = 0; d < q; ++d) {
        const int64_t lo = std::max(r0, s.out_off[d]), hi = std::min(r1, s.out_off[d + 1]);
        if (lo >= hi) continue;
        const int64_t L = len[d];
        const T* w = typed + start[d] + (lo - s.out_off[d]) * L;
        const T* xd = gather ? xg.data() + xg_off[d] : x;
        const int64_t ld_x = gather ? xg_width : K;
        int64_t n = lo;
        // long rows four at a time (each x vector loaded once for four); short rows one
        // at a time, one forward stream (four short rows at once: measured slower)
        for (; L >= kFourRowsMinLength && n + 4 <= hi; n += 4, w += 4 * L) {
          for (int64_t m = 0; m < M; ++m) {
            T out[4] = {0, 0, 0, 0};
            dot4<T>(xd + m * ld_x, w, L, L, out);
            for (int64_t r = 0; r < 4; ++r) {
              y[m * N + n + r] = out[r] + (bias ? bias[n + r] : T(0));
            }
          }
        }
        int64_t n_seg = 0;  // x's segments this group's rows read (adjacent blocks merged)
        if (!seg_off.empty()) {
          for (int64_t b = 0; b < q; ++b) {
            if (!s.uses[(a * q + d) * q + b]) continue;
            const int64_t w_b = s.in_off[b + 1] - s.in_off[b];
            if (n_seg > 0 && seg_off[n_seg - 1] + seg_width[n_seg - 1] == s.in_off[b]) {
              seg_width[n_seg - 1] += w_b;
            } else {
              seg_off[n_seg] = s.in_off[b];
              seg_width[n_seg++] = w_b;
            }
          }
        }
        if (seg_off.empty() || n_seg == 1) {  // the row's inputs are contiguous
          const T* xs = xd + (n_seg == 1 ? seg_off[0] : 0);
          for (; n < hi; ++n, w += L) {
            for (int64_t m = 0; m < M; ++m) {
              y[m * N + n] = dot1<T>(xs + m * ld_x, w, L) + (bias ? bias[n] : T(0));
            }
          }
        }
        for (; n < hi; ++n, w += L) {
          for (int64_t m = 0; m < M; ++m) {
            y[m * N + n] = dot_segments<T>(xd + m * ld_x, seg_off.data(), seg_width.data(),
                                           n_seg, w) +
                           (bias ? bias[n] : T(0));
          }
        }
      }
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                int64_t N, int64_t K, int64_t w_numel) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "fused_rows: CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "fused_rows: x (M, ", K, ") expected, got ",
              x.sizes());
  TORCH_CHECK(w.is_contiguous() && w.numel() == w_numel, "fused_rows: a contiguous weight of ",
              w_numel, " elements expected, got ", w.numel());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "fused_rows: dtype mismatch: x is ",
              x.scalar_type(), ", the weight ", w.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N &&
                    bias->scalar_type() == x.scalar_type() && bias->device().is_cpu(),
                "fused_rows: a contiguous CPU bias of ", N, " elements and dtype ",
                x.scalar_type(), " expected");
  }
}

// The tables as a Support after checking them; N and K from the group offsets.
Support support_of(const at::Tensor& out_off, const at::Tensor& in_off, const at::Tensor& uses,
                   int64_t q) {
  TORCH_CHECK(q >= 1, "fused_rows: q = ", q, " must be >= 1");
  TORCH_CHECK(in_off.numel() == q + 1 && out_off.numel() == q + 1,
              "fused_rows: q + 1 group offsets expected");
  TORCH_CHECK(out_off.scalar_type() == at::kLong && in_off.scalar_type() == at::kLong,
              "fused_rows: int64 offset tables expected");
  TORCH_CHECK(out_off.is_contiguous() && in_off.is_contiguous() && uses.is_contiguous(),
              "fused_rows: contiguous tables expected");
  TORCH_CHECK(uses.scalar_type() == at::kByte && uses.numel() % (q * q) == 0,
              "fused_rows: a uint8 (types, q, q) block-use table expected");
  return Support{q, out_off.data_ptr<int64_t>(), in_off.data_ptr<int64_t>(),
                 uses.data_ptr<uint8_t>()};
}

// The rows' types, each checked to lie in [0, n_types).
const int64_t* checked_types(at::Tensor& types, const at::Tensor& x, int64_t n_types) {
  TORCH_CHECK(types.scalar_type() == at::kLong && types.numel() == x.size(0),
              "fused_rows: one int64 type per row expected");
  types = types.contiguous();
  const int64_t* t = types.data_ptr<int64_t>();
  for (int64_t m = 0; m < types.numel(); ++m) {
    TORCH_CHECK(t[m] >= 0 && t[m] < n_types, "fused_rows: type ", t[m], " outside [0, ",
                n_types, ")");
  }
  return t;
}

// y (M, N) = typed_rows_impl for rows of type `a` (inputs already checked); `typed`'s
// type-a copy starts at element `base`, its row lengths are `len` (q,).
at::Tensor run_typed(at::Tensor x, const at::Tensor& typed, int64_t base, int64_t a,
                     const int64_t* len, const Support& s, const c10::optional<at::Tensor>& bias,
                     int64_t N, int64_t K) {
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "typed_rows_forward", [&] {
    typed_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), typed.data_ptr<scalar_t>() + base, a,
                              len, s, bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr,
                              M, N, K, y.data_ptr<scalar_t>());
  });
  return y;
}

}  // namespace

// x (M, K); packed: the weight (N, K) panel-packed (fused_rows_impl: strips of 16 output
// rows within each output group, each stored transposed); types (M,) int64 in [0, q); out_off / in_off (q + 1,) int64 group offsets; uses
// (types, q, q) uint8: uses[a][d][b] = type a reads block (d, b); bias (N,) or None.
// Returns y (M, N).
at::Tensor fused_rows_forward(at::Tensor x, at::Tensor packed, at::Tensor types,
                              at::Tensor out_off, at::Tensor in_off, at::Tensor uses,
                              int64_t q, c10::optional<at::Tensor> bias) {
  const Support s = support_of(out_off, in_off, uses, q);
  const int64_t N = s.out_off[q], K = s.in_off[q];
  check_rows(x, packed, bias, N, K, N * K);
  const int64_t n_types = uses.numel() / (q * q);
  const int64_t* t = checked_types(types, x, n_types);
  x = x.contiguous();
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fused_rows_forward", [&] {
    fused_rows_impl<scalar_t>(x.data_ptr<scalar_t>(), packed.data_ptr<scalar_t>(), t, s,
                              n_types,
                              bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, M, N,
                              K, y.data_ptr<scalar_t>());
  });
  return y;
}

// The same product, every row of one type, from the typed copies (`typed`: the copies of
// all types back to back, see typed_rows_impl). Tables as for fused_rows_forward.
at::Tensor typed_rows_forward(at::Tensor x, at::Tensor typed, at::Tensor types,
                              at::Tensor out_off, at::Tensor in_off, at::Tensor uses,
                              int64_t q, c10::optional<at::Tensor> bias) {
  const Support s = support_of(out_off, in_off, uses, q);
  const int64_t N = s.out_off[q], K = s.in_off[q], n_types = uses.numel() / (q * q);
  const std::vector<int64_t> lengths = typed_row_lengths(s, n_types);
  int64_t copies = 0;
  std::vector<int64_t> base(n_types);  // type a's copy starts at base[a]
  for (int64_t a = 0; a < n_types; ++a) {
    base[a] = copies;
    copies += typed_copy_size(s, lengths.data() + a * q);
  }
  check_rows(x, typed, bias, N, K, copies);
  const int64_t* t = checked_types(types, x, n_types);
  const int64_t M = x.size(0);
  const int64_t a = M ? t[0] : 0;
  for (int64_t m = 0; m < M; ++m) {
    TORCH_CHECK(t[m] == a, "typed_rows: every row must have one type, got types ", t[0],
                " and ", t[m], " (use fused_rows_forward for mixed types)");
  }
  return run_typed(x, typed, base[a], a, lengths.data() + a * q, s, bias, N, K);
}

// Dense y = x W^T (+ bias) for a few rows, W (N, K) row-major: the typed loop with one
// type, one group and one block (the weight is its own typed copy).
at::Tensor dense_rows_forward(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2, "dense_rows: weight (N, K) expected, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  check_rows(x, w, bias, N, K, N * K);
  const int64_t out_off[2] = {0, N}, in_off[2] = {0, K};
  const uint8_t uses[1] = {1};
  const Support s{1, out_off, in_off, uses};
  const int64_t len[1] = {K};
  return run_typed(x, w, 0, 0, len, s, bias, N, K);
}

namespace structlm {

BoundRows::BoundRows(at::Tensor typed, at::Tensor out_off, at::Tensor in_off, at::Tensor uses,
                     int64_t q, int64_t slot)
    : typed_(std::move(typed)), out_off_(std::move(out_off)), in_off_(std::move(in_off)),
      uses_(std::move(uses)), slot_(slot) {
  s_ = support_of(out_off_, in_off_, uses_, q);
  N_ = s_.out_off[q];
  K_ = s_.in_off[q];
  n_types_ = uses_.numel() / (q * q);
  TORCH_CHECK(slot_ >= -1, "BoundRows: slot ", slot_, " must be >= -1");
  TORCH_CHECK(typed_.device().is_cpu(), "BoundRows: a CPU weight expected");
  lengths_ = typed_row_lengths(s_, n_types_);
  base_.resize(n_types_ + 1, 0);
  for (int64_t a = 0; a < n_types_; ++a) {
    base_[a + 1] = base_[a] + typed_copy_size(s_, lengths_.data() + a * q);
  }
  TORCH_CHECK(typed_.is_contiguous() && typed_.numel() == base_[n_types_],
              "BoundRows: contiguous typed copies of ", base_[n_types_], " elements expected, "
              "got ", typed_.numel());
}

at::Tensor BoundRows::forward(const at::Tensor& x, int64_t type,
                              const c10::optional<at::Tensor>& bias) const {
  TORCH_CHECK(type >= 0 && type < n_types_, "BoundRows: type ", type, " outside [0, ",
              n_types_, ")");
  return run_typed(x, typed_, base_[type], type, lengths_.data() + type * s_.q, s_, bias, N_,
                   K_);
}

}  // namespace structlm
