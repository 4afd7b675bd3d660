// One tile of the statistics' tiled pass (attnkit/stats/tiled.py), float32, each row read from cache while it is
// there: its weights exp(score - lse), its sums for the entropy, mass, sink and mean distance, its head's column
// sums, and its top-k so far. Built on first use by attnkit/csrc/__init__.py; tiled.py's torch ops compute the
// same (float64, and where the kernel cannot be built), and the tests hold the two to the float64 reference.
//
// Shapes: r rows of a tile (G query heads' n rows each, one key/value head's), w keys of a tile, k the top-k.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "common.h"

namespace {

// The top-k search's groups: GROUP keys, STRIDE apart (see top_k).
constexpr int64_t GROUP = 16;
constexpr int64_t STRIDE = 4;
// A tile's rows are split into this many parts, each a task for a thread (fixed: see tile()).
constexpr int64_t PARTS = 16;
// exp() of less than log(FLT_MIN) + 1 is taken one by one with std::exp (subnormal weights and 0), as tiled.py's
// _LOWEST; above it the polynomial of common.h, within 2 units in the last place (Cephes' expf).
constexpr float LOWEST = -86.3365478515625f;  // float32(log(FLT_MIN) + 1), as tiled.py's

struct Tile {
  const float* t;          // (r, w) scores, scaled, before the mask
  const float* shift;      // (r,) -lse
  const int64_t* qpos;     // (r,) positions
  int64_t a, real, width;  // the tile's first key, the keys that exist, the keys it holds
  bool causal;
  int64_t sink_keys;
  int64_t n, k;            // rows of each head, the top-k
  double* sums;            // (4, r)
  float* top_scores;       // (r, k) descending: the row's k largest scores so far
  float* top_values;       // (r, k) their weights
  int64_t* top_indices;    // (r, k) their keys
  int64_t r;
};

// A row's top-k as a min-heap on the score (its root the k-th largest so far): key j, of score x and weight e,
// takes the root's place and sinks to where it belongs.
inline void push(float* scores, float* values, int64_t* indices, int64_t k, float x, float e, int64_t j) {
  int64_t p = 0;
  while (true) {
    const int64_t l = 2 * p + 1, r = l + 1;
    int64_t least = p;
    float below = x;
    if (l < k && scores[l] < below) least = l, below = scores[l];
    if (r < k && scores[r] < below) least = r, below = scores[r];
    if (least == p) break;
    scores[p] = scores[least];
    values[p] = values[least];
    indices[p] = indices[least];
    p = least;
  }
  scores[p] = x;
  values[p] = e;
  indices[p] = j;
}

inline float* scores_of(const Tile& T, int64_t i) { return T.top_scores + i * T.k; }

// Row i's keys [0, end) of the tile (scores ti, weights wi) merged into its top-k. A key can be among the k largest
// only if it beats the heap's root and is at least the k-th largest of the maxima of the tile's groups (k groups
// of larger maxima hold k keys at least as large); each group is GROUP keys, those of a run of GROUP * STRIDE
// apart by STRIDE (their maxima are elementwise maxima of consecutive vectors: no horizontal reduction). The keys
// that pass both, at most STRIDE keys of each of k groups past ties, are gathered without branching on their
// scores (a branch per key on random scores mispredicts half the time), then pushed.
__attribute__((noinline)) void top_k(const Tile& T, int64_t i, const float* ti, const float* wi, int64_t end, float* groups, float* ranked) {
  float* scores = scores_of(T, i);
  float* values = T.top_values + i * T.k;
  int64_t* indices = T.top_indices + i * T.k;
  const int64_t k = T.k, run = GROUP * STRIDE, runs = (end + run - 1) / run;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t u = 0; u < runs; ++u) {
    const int64_t u0 = u * run;
    float* g = groups + u * GROUP;
    if (u0 + run <= end) {
#pragma omp simd
      for (int64_t l = 0; l < GROUP; ++l) {
        float m = ti[u0 + l];
        for (int64_t v = 1; v < STRIDE; ++v) m = std::max(m, ti[u0 + v * GROUP + l]);
        g[l] = m;
      }
    } else {  // the last, partial run
      for (int64_t l = 0; l < GROUP; ++l) g[l] = neg_inf;
      for (int64_t j = u0; j < end; ++j) g[(j - u0) % GROUP] = std::max(g[(j - u0) % GROUP], ti[j]);
    }
  }
  const float root = scores[0];
  const int64_t count = runs * GROUP;
  int64_t above = 0;
  for (int64_t c = 0; c < count; ++c) {
    ranked[above] = groups[c];
    above += groups[c] > root ? 1 : 0;
  }
  // the least score a key must have: just above the root, or the k-th largest group maximum where more groups
  // than k beat the root (that maximum beats it too)
  float least = std::nextafter(root, std::numeric_limits<float>::infinity());
  if (above > k) {
    std::nth_element(ranked, ranked + (k - 1), ranked + above, std::greater<float>());
    least = ranked[k - 1];
  }
  int64_t picked[STRIDE];
  for (int64_t c = 0; c < count; ++c) {
    if (!(groups[c] >= least)) continue;
    const int64_t first = c / GROUP * run + c % GROUP;
    int64_t found = 0;
    for (int64_t v = 0; v < STRIDE; ++v) {
      const int64_t j = first + v * GROUP;
      picked[found] = j;
      found += (j < end && ti[j] >= least) ? 1 : 0;
    }
    for (int64_t p = 0; p < found; ++p) {
      const int64_t j = picked[p];
      if (ti[j] > scores[0]) push(scores, values, indices, k, ti[j], wi[j], T.a + j);
    }
  }
}

// The rows [i0, i1) of a tile, their weights in the scratch row `wi` (width), each head's column sums added to
// `column` (the heads from first_head on, width each); `groups` and `ranked` scratch for top_k (width / STRIDE,
// rounded up, each).
void rows(const Tile& T, int64_t i0, int64_t i1, float* wi, float* column, int64_t first_head, float* groups,
          float* ranked) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = i0; i < i1; ++i) {
    const float* ti = T.t + i * T.width;
    // keys [0, end) of the tile are the row's to see: the rest hide behind its position or do not exist
    const int64_t end = T.causal ? std::clamp<int64_t>(T.qpos[i] - T.a + 1, 0, T.real) : T.real;
    const float s = T.shift[i];
    const float here = static_cast<float>(T.qpos[i] - T.a);  // the row's position from the tile's first key
    float entropy = 0.f, mass = 0.f, distance = 0.f, highest = neg_inf;
    int32_t under = 0;
#pragma omp simd reduction(+ : entropy, mass, distance, under)
    for (int64_t j = 0; j < end; ++j) {
      const float x = ti[j] + s;  // log w (NaN stays NaN, and so does every sum of its row)
      const bool low = x < LOWEST;
      const float e = low ? 0.f : attnkit::exp_polynomial(x);
      wi[j] = e;
      entropy += low ? 0.f : e * x;
      mass += e;
      distance += e * std::fabs(here - static_cast<float>(j));
      under += (low && x > neg_inf) ? 1 : 0;
    }
    double fine = 0.0, fine_mass = 0.0, fine_distance = 0.0;
    if (under > 0) {  // weights below FLT_MIN * e: subnormal or 0, each from std::exp
      for (int64_t j = 0; j < end; ++j) {
        const float x = ti[j] + s;
        if (x < LOWEST && x > neg_inf) {
          const float e = std::exp(x);
          wi[j] = e;
          fine += static_cast<double>(e) * x;
          fine_mass += e;
          fine_distance += static_cast<double>(e) * std::fabs(here - static_cast<float>(j));
        }
      }
    }
    float sink = 0.f;
    const int64_t sunk = std::min(end, T.sink_keys - T.a);
    for (int64_t j = 0; j < sunk; ++j) sink += wi[j];
    double* out = T.sums + i;
    out[0] += static_cast<double>(entropy) + fine;
    out[T.r] += static_cast<double>(mass) + fine_mass;
    out[2 * T.r] += static_cast<double>(sink);
    out[3 * T.r] += static_cast<double>(distance) + fine_distance;
    float* col = column + (i / T.n - first_head) * T.width;
#pragma omp simd
    for (int64_t j = 0; j < end; ++j) col[j] += wi[j];
    highest = attnkit::largest(ti, end);
    // the top-k (a heap whose root is the row's k-th largest score so far)
    if (!(highest > scores_of(T, i)[0])) continue;  // no key of the tile beats the row's k-th (most tiles)
    top_k(T, i, ti, wi, end, groups, ranked);
  }
}

// t (r, w): a tile's scores (scaled, before the mask), keys [a, a + w) of which [a, a + real) exist; shift (r,):
// -lse of each row; qpos (r,): each row's position (keys past it hide where causal); sink_keys: keys before it are
// the sink's; n rows of each head (row i is head i / n's). Adds to sums (4, r) float64: sum_j w log w, sum_j w,
// the weight on keys before sink_keys, sum_j w |pos(i) - j|; to column (G, >= real) float32 (a view: rows of any
// stride) each head's weight on each key; and merges the tile's keys into each row's top-k so far, top_scores,
// top_values (r, k) float32 and top_indices (r, k) int64, a min-heap on the score in each row (start from -inf,
// 0, -1: no key yet; sort them by score at the end).
void tile(const at::Tensor& t, const at::Tensor& shift, const at::Tensor& qpos, int64_t a, int64_t real, bool causal,
          int64_t sink_keys, int64_t n, const at::Tensor& sums, const at::Tensor& column, const at::Tensor& top_scores,
          const at::Tensor& top_values, const at::Tensor& top_indices) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kFloat, "t: a contiguous float32 matrix");
  const int64_t r = t.size(0), width = t.size(1);
  TORCH_CHECK(real >= 0 && real <= width && n > 0 && r % n == 0, "real <= width, r = G n");
  const int64_t G = r / n, k = top_scores.size(-1);
  TORCH_CHECK(shift.is_contiguous() && shift.scalar_type() == at::kFloat && shift.numel() == r, "shift");
  TORCH_CHECK(qpos.is_contiguous() && qpos.scalar_type() == at::kLong && qpos.numel() == r, "qpos");
  TORCH_CHECK(sums.is_contiguous() && sums.scalar_type() == at::kDouble && sums.numel() == 4 * r, "sums");
  TORCH_CHECK(column.dim() == 2 && column.scalar_type() == at::kFloat && column.size(0) == G &&
                  column.size(1) >= real && column.stride(1) == 1,
              "column");
  TORCH_CHECK(k > 0 && top_scores.is_contiguous() && top_scores.scalar_type() == at::kFloat &&
                  top_scores.numel() == r * k,
              "top_scores");
  TORCH_CHECK(top_values.is_contiguous() && top_values.scalar_type() == at::kFloat && top_values.numel() == r * k,
              "top_values");
  TORCH_CHECK(top_indices.is_contiguous() && top_indices.scalar_type() == at::kLong &&
                  top_indices.numel() == r * k,
              "top_indices");
  const Tile T{t.data_ptr<float>(), shift.data_ptr<float>(), qpos.data_ptr<int64_t>(), a, real, width, causal,
               sink_keys, n, k, sums.data_ptr<double>(), top_scores.data_ptr<float>(), top_values.data_ptr<float>(),
               top_indices.data_ptr<int64_t>(), r};
  if (r == 0) return;
  // the rows in PARTS parts, whatever the threads: each part's column sums apart (over the heads its rows are
  // of), added in part order after, so that the sums are the same bits on any number of threads
  const int64_t parts = std::min<int64_t>(PARTS, r), per = (r + parts - 1) / parts;
  const int64_t groups = (width + GROUP * STRIDE - 1) / (GROUP * STRIDE) * GROUP;
  // part p: rows [p per, ...), of heads [first[p], last[p]], its column sums at offset[p] in partial
  std::vector<int64_t> first(parts), last(parts), offset(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p) {
    first[p] = std::min(r - 1, p * per) / n;
    last[p] = (std::min(r, (p + 1) * per) - 1) / n;
    offset[p + 1] = offset[p] + (last[p] - first[p] + 1) * width;
  }
  std::vector<float> partial(static_cast<size_t>(offset[parts]), 0.f);
  std::vector<float> scratch(static_cast<size_t>(parts * (width + 2 * groups)));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* own = scratch.data() + p * (width + 2 * groups);
      rows(T, std::min(r, p * per), std::min(r, (p + 1) * per), own, partial.data() + offset[p], first[p],
           own + width, own + width + groups);
    }
  });
  float* col = column.data_ptr<float>();
  const int64_t stride = column.stride(0);
  for (int64_t p = 0; p < parts; ++p) {  // in part order
    if (p * per >= r) break;
    for (int64_t g = first[p]; g <= last[p]; ++g) {
      const float* from = partial.data() + offset[p] + (g - first[p]) * width;
      float* c = col + g * stride;
#pragma omp simd
      for (int64_t j = 0; j < real; ++j) c[j] += from[j];
    }
  }
}

}  // namespace

TORCH_LIBRARY(attnkit_stats, m) {
  m.def(
      "tile(Tensor t, Tensor shift, Tensor qpos, int a, int real, bool causal, int sink_keys, int n, Tensor(a!) sums, "
      "Tensor(b!) column, Tensor(c!) top_scores, Tensor(d!) top_values, Tensor(e!) top_indices) -> ()");
}

TORCH_LIBRARY_IMPL(attnkit_stats, CPU, m) { m.impl("tile", tile); }
