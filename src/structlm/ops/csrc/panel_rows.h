// The panel-packed kernel for rows of mixed types (fused_rows_forward in fused_rows.cpp):
// any number of rows against the panel-packed copy of a weight (strips of kPanel output
// rows, each stored transposed; see panel.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "panel.h"
#include "rows_kernel.h"

namespace structlm {

// Rows per row block of the panel-packed kernel: 2 threads, K = N = 4096, M = 4096
// cyclic, Q4-Q32 (AMD EPYC VM): 256 and 1024 within a few percent of 512 (Q32 60.1 /
// 54.3 / 54.9 ms); without blocks (every row per strip) 0.94-1.01x of diag-first there.
constexpr int64_t kRowBlock = 512;
// Row blocks with at least this many rows per type present go type by type (see
// fused_rows_impl). Both ways forced, 2 threads, warm 4096^2 and 1024^2 weights, cyclic
// types (AMD EPYC VM): type by type faster from 32 rows per type (dense at M = 32 6.15 ->
// 5.61 ms, Q2 at M = 64 8.82 -> 8.02, Q2^2 at M = 256 25.2 -> 22.5), slower at 2-16 (Q4
// at M = 16 2.28 -> 2.45, Q8 at M = 32 2.44 -> 2.60).
constexpr int64_t kSegmentRowsPerType = 32;
// Not done: taking a block 256 inputs at a time from nine rows (every group of rows
// against an L1-sized chunk of the panels): 1.11-1.33x slower at M = 16-64 on an AMD EPYC
// (Zen 4) VM (two alternations, both builds under OMP_WAIT_POLICY=PASSIVE), where the dense
// M = 32 call runs at the GEMM rate measured in the run
// (benchmarks/results/few_row_input_chunks.md).

// The rows sorted by type and each (type, output group)'s input segments (fused_rows_impl).
struct ByType {
  const int64_t* order;       // (M,) rows sorted by type
  const int64_t* type_start;  // (n_types + 1,) type a's rows at order[type_start[a] ..]
  int64_t n_types;
  const int64_t* seg_off;     // segment i: input columns seg_off[i] .. + seg_width[i]
  const int64_t* seg_width;
  const int64_t* seg_begin;   // (n_types q + 1,) type a, group d: segments seg_begin[a q + d] ..
  int64_t q;
};

// Rows [c0, c1) of the sorted order, type by type, against `strips` full strips (a pair,
// or two pairs) from output row n0 of group d: six rows at a time over all the type's
// segments (panel_segments), stored straight into y (+ bias). `pans`: room for q panel
// pointers.
inline void strips_by_type(const float* x, const float* packed, const float* bias,
                           const ByType& t, int64_t c0, int64_t c1, int64_t d, int64_t n0,
                           int64_t N, int64_t K, int strips, const float** pans, float* y) {
  const int64_t gap = kPanel * K;
  for (int64_t a = 0; a < t.n_types; ++a) {
    const int64_t r0 = std::max(t.type_start[a], c0), r1 = std::min(t.type_start[a + 1], c1);
    if (r0 >= r1) continue;
    const int64_t sb = t.seg_begin[a * t.q + d], n_seg = t.seg_begin[a * t.q + d + 1] - sb;
    for (int64_t i = 0; i < n_seg; ++i) pans[i] = packed + n0 * K + t.seg_off[sb + i] * kPanel;
    for (int64_t i = r0, n = 0; i < r1; i += n) {
      n = std::min<int64_t>(kPairRows, r1 - i);
      const float* xs[kPairRows];
      float* ys[kPairRows];
      for (int64_t r = 0; r < n; ++r) {
        xs[r] = x + t.order[i + r] * K;
        ys[r] = y + t.order[i + r] * N + n0;
      }
      panel_segments(xs, n, t.seg_off + sb, t.seg_width + sb, pans, n_seg, gap, ys,
                     bias ? bias + n0 : nullptr, strips);
    }
  }
}

// Panel-packed weight, rows of any types. Each output group's rows are cut into strips of
// kPanel rows (the last one the rows left over), each strip stored transposed: the strip
// of pw rows from output row n0 is the (K, pw) matrix W[n0 : n0 + pw, :]^T, row-major, at
// element n0 * K; block (d, b)'s panel of it is its rows in_off[b] .. in_off[b + 1], at
// n0 * K + in_off[b] * pw. A thread takes strips of every output group and reads each
// strip front to back (one forward stream), the blocks' parts that some row uses. Row
// blocks with many rows per type go type by type (strips_by_type: all of a type's blocks
// of two or four strips in one register-accumulated call per six rows); the others block by block:
// per panel, the rows that read it six at a time against a strip pair (AVX-512) or four
// (eight with AVX-512) against one strip, accumulated in memory between blocks.
template <typename T>
void fused_rows_impl(const T* x, const T* packed, const int64_t* types, const Support& s,
                     int64_t n_types, const T* bias, int64_t M, int64_t N, int64_t K, T* y) {
  const int64_t q = s.q;
  // The rows sorted by type (a counting sort: order[type_start[a] ..] are type a's rows,
  // ascending), for the row blocks and the type-by-type calls.
  std::vector<int64_t> type_start(n_types + 1, 0), order(M);
  for (int64_t m = 0; m < M; ++m) ++type_start[types[m] + 1];
  for (int64_t a = 0; a < n_types; ++a) type_start[a + 1] += type_start[a];
  {
    std::vector<int64_t> cursor(type_start.begin(), type_start.end() - 1);
    for (int64_t m = 0; m < M; ++m) order[cursor[types[m]]++] = m;
  }
  // Row blocks of the sorted order, at most kRowBlock rows each, cut at a type boundary
  // where one lies in the block's second half (a type's blocks are then read once per
  // row block it spans): the accumulators and the rows' inputs of a block stay in L2.
  std::vector<int64_t> cuts{0};
  while (cuts.back() < M) {
    const int64_t c = cuts.back(), lim = std::min(c + kRowBlock, M);
    int64_t e = lim;
    for (int64_t a = n_types; lim < M && a-- > 0;) {
      if (type_start[a] <= lim) {
        if (2 * (type_start[a] - c) > lim - c) e = type_start[a];
        break;
      }
    }
    cuts.push_back(e);
  }
  // Row blocks with at least kSegmentRowsPerType rows per type present go type by type:
  // each type's rows against all its blocks of two or four strips in one call per six rows
  // (panel_segments: the blocks as input segments, accumulators in registers, stored
  // once into y). Fewer rows per type go block by block, each block's panel once for all
  // the rows that read it (accumulated in acc), as few-row calls want.
  std::vector<uint8_t> by_type(cuts.size() - 1, 0);
  bool any_by_type = false;
  for (size_t ci = 0; kPairedPanels && std::is_same_v<T, float> &&
                      ci + 1 < cuts.size(); ++ci) {
    int64_t present = 0;
    for (int64_t a = 0; a < n_types; ++a) {
      present += std::min(type_start[a + 1], cuts[ci + 1]) > std::max(type_start[a], cuts[ci]);
    }
    by_type[ci] = cuts[ci + 1] - cuts[ci] >= kSegmentRowsPerType * present;
    any_by_type = any_by_type || by_type[ci];
  }
  // For the block-by-block calls: each row block's users of each block (d, b), at
  // users[user_begin[(ci q + d) q + b] ..], and row m's place in its row block's
  // accumulators (slot). With one row block the rows go in ascending order and slot[m] = m:
  // a call's six rows then lie next to each other in memory (sorted by type, with cyclic
  // types one type's rows lie q rows apart, in the same cache sets: Q8 at M = 32, 4096^2
  // ~20% slower); with several, in the sorted order and slot = the position less the row
  // block's first. Built from each present type's block list in O(types q^2 + rows x
  // blocks per type); a q^2 M table of row lists cost Q32 at M = 2048 16 MB and ~5 ms
  // serial per call. Each row still accumulates its blocks in ascending b.
  const int64_t n_blocks = static_cast<int64_t>(cuts.size()) - 1;
  std::vector<int64_t> user_begin(n_blocks * q * q + 1, 0), users, slot(M);
  {
    std::vector<std::vector<int64_t>> blocks_of(n_types);
    for (int64_t a = 0; a < n_types; ++a) {
      for (int64_t db = 0; type_start[a + 1] > type_start[a] && db < q * q; ++db) {
        if (s.uses[a * q * q + db]) blocks_of[a].push_back(db);
      }
    }
    // the rows of row block ci in the order its calls take them
    auto row_at = [&](int64_t ci, int64_t i) { return n_blocks == 1 ? i : order[i]; };
    for (int64_t ci = 0; ci < n_blocks; ++ci) {
      for (int64_t i = cuts[ci]; i < cuts[ci + 1]; ++i) {
        const int64_t m = row_at(ci, i);
        slot[m] = i - cuts[ci];
        for (const int64_t db : blocks_of[types[m]]) ++user_begin[ci * q * q + db + 1];
      }
    }
    for (int64_t j = 0; j < n_blocks * q * q; ++j) user_begin[j + 1] += user_begin[j];
    users.resize(user_begin[n_blocks * q * q]);
    std::vector<int64_t> cursor(user_begin.begin(), user_begin.end() - 1);
    for (int64_t ci = 0; ci < n_blocks; ++ci) {
      for (int64_t i = cuts[ci]; i < cuts[ci + 1]; ++i) {
        const int64_t m = row_at(ci, i);
        for (const int64_t db : blocks_of[types[m]]) users[cursor[ci * q * q + db]++] = m;
      }
    }
  }
  // each (type, output group)'s input segments: its blocks' input columns, adjacent blocks
  // merged (their panels are adjacent in a strip too); built only where used
  std::vector<int64_t> seg_off, seg_width, seg_begin(any_by_type ? n_types * q + 1 : 0, 0);
  for (int64_t ad = 0; any_by_type && ad < n_types * q; ++ad) {
    const size_t first = seg_off.size();
    for (int64_t b = 0; b < q; ++b) {
      if (!s.uses[ad * q + b]) continue;
      const int64_t w_b = s.in_off[b + 1] - s.in_off[b];
      if (seg_off.size() > first && seg_off.back() + seg_width.back() == s.in_off[b]) {
        seg_width.back() += w_b;
      } else {
        seg_off.push_back(s.in_off[b]);
        seg_width.push_back(w_b);
      }
    }
    seg_begin[ad + 1] = static_cast<int64_t>(seg_off.size());
  }
  const int64_t n_panels = (N + kPanel - 1) / kPanel;  // about: groups round up
  const int64_t n_threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_panels));
  // rows `rows[k0..k1)` against the panel of block (d, b) of the strip at output row n0
  // (pw outputs), accumulated into acc (row m's kPanel floats at acc + slot[m] kPanel)
  auto strip_rows = [&](const int64_t* rows, int64_t k0, int64_t k1, int64_t b, int64_t n0,
                        int64_t pw, T* acc) {
    const int64_t width = s.in_off[b + 1] - s.in_off[b];
    const T* pan = packed + n0 * K + s.in_off[b] * pw;
    for (int64_t k = k0; k < k1; k += kPanelRowsPerCall) {
      const int64_t n_rows = std::min<int64_t>(kPanelRowsPerCall, k1 - k);
      const T* xs[kPanelRowsPerCall];
      T* as[kPanelRowsPerCall];
      for (int64_t r = 0; r < n_rows; ++r) {
        xs[r] = x + rows[k + r] * K + s.in_off[b];
        as[r] = acc + slot[rows[k + r]] * kPanel;
      }
      if (pw == kPanel) {
        panel_rows<T>(xs, n_rows, pan, width, as);
      } else {
        panel_rows_generic<T>(xs, n_rows, pan, width, pw, as);
      }
    }
  };
  const ByType tables{order.data(), type_start.data(), n_types, seg_off.data(),
                      seg_width.data(), seg_begin.data(), q};
  at::parallel_for(0, n_threads, 1, [&](int64_t t0, int64_t t1) {
    const int64_t acc_rows = std::min(M, kRowBlock);
    std::vector<T> acc(acc_rows * kPanel), acc2(acc_rows * kPanel);
    std::vector<const float*> pans(any_by_type ? q : 0);  // a type's segments' panels
    for (int64_t t = t0; t < t1; ++t) {
      for (size_t ci = 0; ci + 1 < cuts.size(); ++ci) {
        const int64_t c0 = cuts[ci], c1 = cuts[ci + 1];
        for (int64_t d = 0; d < q; ++d) {
          const int64_t rows_d = s.out_off[d + 1] - s.out_off[d];
          const int64_t panels_d = (rows_d + kPanel - 1) / kPanel;
          // thread t's panels of group d: every row of a group uses the same blocks, so
          // the threads get equal work whatever the types
          const int64_t p_end = (t + 1) * panels_d / n_threads;
          int64_t p = t * panels_d / n_threads;
          if constexpr (std::is_same_v<T, float>) {
            // by type: two strip pairs per call where four full strips remain (each input
            // broadcast once for four weight vectors: A/B alternated twice, M = 2048,
            // 4096^2, AMD EPYC VM: Q32 27.5 / 26.8 -> 25.0 / 24.3 ms, Q16 43.6 / 43.3 ->
            // 40.8 / 41.2, Q4 1-2% faster, the dense loop level), then one pair
            for (const int strips : {4, 2}) {
              for (; by_type[ci] && p + strips <= p_end && rows_d - p * kPanel >= strips * kPanel;
                   p += strips) {
                strips_by_type(x, packed, bias, tables, c0, c1, d, s.out_off[d] + p * kPanel,
                               N, K, strips, pans.data(), y);
              }
            }
          }
          while (p < p_end) {
            const int64_t n0 = s.out_off[d] + p * kPanel;
            const int64_t pw = std::min(kPanel, s.out_off[d + 1] - n0);
            // two full strips at once where the pair kernel applies (each input broadcast
            // once for both strips' weight vectors)
            const bool pair = kPairedPanels && std::is_same_v<T, float> && p + 1 < p_end &&
                              s.out_off[d + 1] - n0 >= 2 * kPanel;
            std::fill(acc.begin(), acc.begin() + (c1 - c0) * kPanel, T(0));
            if (pair) std::fill(acc2.begin(), acc2.begin() + (c1 - c0) * kPanel, T(0));
            for (int64_t b = 0; b < q; ++b) {
              const int64_t cb = (static_cast<int64_t>(ci) * q + d) * q + b;
              const int64_t* rows = users.data() + user_begin[cb];
              const int64_t count = user_begin[cb + 1] - user_begin[cb];
              if (count == 0) continue;
              int64_t k = 0;
              if constexpr (std::is_same_v<T, float>) {
                if (pair) {
                  const int64_t width = s.in_off[b + 1] - s.in_off[b];
                  const float* pan0 = packed + n0 * K + s.in_off[b] * kPanel;
                  const float* pan1 = pan0 + kPanel * K;
                  // a dense weight at few rows: the first call prefetches the next pair's
                  // panels (see kPrefetchMaxRows)
                  const bool prefetch = q == 1 && count <= kPrefetchMaxRows && p + 3 < p_end &&
                                        s.out_off[d + 1] - n0 >= 4 * kPanel;
                  const float* next = prefetch ? pan0 + 2 * kPanel * K : nullptr;  // 2 strips
                  // six rows at a time, then the last one to five also against both
                  // strips (panel_pair_rows_rest: each input broadcast once for both; see
                  // the A/B in docs/benchmarks.md, M = 32)
                  for (int64_t n = 0; k < count; k += n) {
                    n = std::min<int64_t>(kPairRows, count - k);
                    const float* xs[kPairRows];
                    float* as0[kPairRows];
                    float* as1[kPairRows];
                    for (int64_t r = 0; r < n; ++r) {
                      xs[r] = x + rows[k + r] * K + s.in_off[b];
                      as0[r] = acc.data() + slot[rows[k + r]] * kPanel;
                      as1[r] = acc2.data() + slot[rows[k + r]] * kPanel;
                    }
                    if (n == kPairRows) {
                      panel_pair_rows(xs, pan0, pan1, width, as0, as1, k == 0 ? next : nullptr);
                    } else {
                      panel_pair_rows_rest(xs, n, pan0, pan1, width, as0, as1);
                    }
                  }
                }
              }
              strip_rows(rows, k, count, b, n0, pw, acc.data());
              if (pair) strip_rows(rows, k, count, b, n0 + kPanel, kPanel, acc2.data());
            }
            for (int64_t i = c0; i < c1; ++i) {
              const int64_t m = order[i];
              const T* a1 = acc.data() + slot[m] * kPanel;
              for (int64_t j = 0; j < pw; ++j) {
                y[m * N + n0 + j] = a1[j] + (bias ? bias[n0 + j] : T(0));
              }
              if (!pair) continue;
              const T* a2 = acc2.data() + slot[m] * kPanel;
              for (int64_t j = 0; j < kPanel; ++j) {
                const int64_t n = n0 + kPanel + j;
                y[m * N + n] = a2[j] + (bias ? bias[n] : T(0));
              }
            }
            p += pair ? 2 : 1;
          }
        }
      }
    }
  });
}

}  // namespace structlm
