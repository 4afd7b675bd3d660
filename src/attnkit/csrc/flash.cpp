// Flash attention on the CPU, float32 (and bfloat16 inputs with `low`: their products on the CPU's bfloat16 dot
// products where it has them, bf16.h, the softmax and every sum in float32; given as they are where every key and
// value is finite, else in float32), forward and backward,
// over the blocks of queries of a plan, with a built-in
// score_mod: soft-capping (cap * tanh(score / cap), as FlashAttention's own `softcap`) or a bias on the distance
// q_idx - kv_idx (score + f(b, h, q_idx - kv_idx): a learned table of relative-position biases, read as one vector
// per (example, head), its gradient given back as one), the mask of each tile given as a bool tile and a float bias
// tile. attnkit/backends/tiles/kernel.py plans the tiles (attnkit/plan.py) and builds the masks of the
// partly visible ones; this file runs each (example, head) of each block of queries over its tiles, reading and
// writing the call's tensors in place, the scores of a tile kept in cache from the product that makes them to the
// products that read them (where the compiled steps of attnkit/backends/tiles/compiled.py write each step's (B, H, n, c)
// tile to memory and read it back).
//
// Shapes: B batch, H heads, Lq queries, n a block's queries, Lk keys, D head dim, Dv value head dim, c a tile's keys.
// The semantics are those of attnkit/backends/tiles/compiled_steps.py: a score of -inf hides its key, a row that sees no
// key gets zeros and a log-sum-exp of 0, and where `guard` says some key or value is not finite, the products that
// read keys and values into rows skip the pairs a row may not see (0 * inf would be NaN there).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/List.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "common.h"

namespace {

constexpr float INF = std::numeric_limits<float>::infinity();
// exp() below this is taken as 0: a weight under e^-69 = 1e-30 of its row's largest (whose weight is 1) changes no
// float32 sum of the row, and one near float32's smallest normal numbers (e^-87) made products with values
// subnormal, which this machine's cores compute through a slow assist (ALiBi's far keys made the forward 15-50%
// slower at -87; PyTorch's own backward kernel, which keeps them, took 4x longer on ALiBi's tiles: docs/benchmarks.md)
constexpr float LOWEST = -69.0f;

// exp(x): attnkit's polynomial (common.h); 0 below LOWEST (-inf included), NaN for NaN; branch-free, so that the loops
// that call it vectorize.
inline float fast_exp(float x) {
  const float e = attnkit::exp_polynomial(std::max(x, LOWEST));
  return x < LOWEST ? 0.0f : (x != x ? x : e);
}

// tanh(x), as Cephes' tanhf: an odd polynomial where |x| < 0.625, 1 - 2 / (exp(2 |x|) + 1) with the sign of x
// elsewhere; both computed and one kept, so that the loops vectorize. +-1 at +-inf, NaN for NaN.
inline float fast_tanh(float x) {
  const float z = std::fabs(x);
  const float s = x * x;
  float p = -5.70498872745e-3f;
  p = p * s + 2.06390887954e-2f;
  p = p * s - 5.37397155531e-2f;
  p = p * s + 1.33314422036e-1f;
  p = p * s - 3.33332819422e-1f;
  const float small = p * s * x + x;
  const float e = fast_exp(std::min(2.0f * z, 88.0f));
  const float large = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return z < 0.625f ? small : large;
}

// C (M x N, row-major, ldc) = alpha op(A) op(B) + beta C, op(A) M x K, op(B) K x N, each row-major (lda, ldb),
// transposed where ta / tb: through the BLAS PyTorch links (MKL's sgemm_, which PyTorch's CPU library exports;
// column-major, so it computes C^T = op(B)^T op(A)^T). Where it is not there, the kernel does not load, and the
// dispatcher runs its calls on another of the tile engine's implementations (attnkit/dispatch.py).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);

inline void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const char tra = tb ? 'T' : 'N', trb = ta ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  // (a leading dimension is at least 1 where a matrix has no columns: D = 0)
  const int la = static_cast<int>(std::max<int64_t>(ldb, 1)), lb = static_cast<int>(std::max<int64_t>(lda, 1));
  const int lc = static_cast<int>(std::max<int64_t>(ldc, 1));
  sgemm_(&tra, &trb, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// A (B|1, H|1, n, c) tile of a mask, read through its strides (0 where it broadcasts).
template <typename T>
struct Part {
  const T* data = nullptr;
  int64_t sb = 0, sh = 0, si = 0, sj = 0;

  static Part of(const c10::optional<at::Tensor>& t) {
    Part p;
    if (!t.has_value() || !t->defined()) return p;
    p.data = t->data_ptr<T>();
    p.sb = t->size(0) == 1 ? 0 : t->stride(0), p.sh = t->size(1) == 1 ? 0 : t->stride(1);
    p.si = t->stride(2), p.sj = t->stride(3);
    return p;
  }
  const T* at(int64_t b, int64_t h, int64_t i) const { return data + b * sb + h * sh + i * si; }
};

// The blocks of queries of a call (or of a group of its blocks): block x covers rows [r0[x], r1[x]) and tiles
// [first[x], first[x + 1]); tile t covers keys [j0[t], j1[t]), its allowed and bias parts (B|1, H|1, n, c), n its
// block's rows.
struct Plan {
  std::vector<int64_t> r0, r1, first;
  std::vector<int64_t> j0, j1;
  std::vector<Part<bool>> allowed;
  std::vector<Part<float>> bias;
  int64_t widest = 0, tallest = 0;  // the most keys of a tile, the most rows of a block

  int64_t blocks() const { return static_cast<int64_t>(r0.size()); }
};

Plan plan_of(const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& spans,
             const c10::List<c10::optional<at::Tensor>>& allowed, const c10::List<c10::optional<at::Tensor>>& bias,
             int64_t B, int64_t H, int64_t Lq, int64_t Lk) {
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == 2 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "rows: (NB, 2) int64");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 2 && spans.scalar_type() == at::kLong && spans.is_contiguous(),
              "spans: (T, 2) int64");
  const int64_t NB = rows.size(0), T = spans.size(0);
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == NB + 1 && starts.scalar_type() == at::kLong &&
                  starts.is_contiguous(),
              "starts: (NB + 1,) int64");
  TORCH_CHECK(static_cast<int64_t>(allowed.size()) == T && static_cast<int64_t>(bias.size()) == T,
              "one allowed and one bias (or None) per tile");
  Plan out;
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* f = starts.data_ptr<int64_t>();
  const int64_t* s = spans.data_ptr<int64_t>();
  TORCH_CHECK(f[0] == 0 && f[NB] == T, "starts: from 0 to T");
  for (int64_t x = 0; x < NB; ++x) {
    const int64_t r0 = r[2 * x], r1 = r[2 * x + 1], n = r1 - r0;
    TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= Lq, "a block's rows lie in [0, Lq)");
    TORCH_CHECK(x == 0 || r[2 * x - 1] <= r0, "blocks in order, apart (each writes its rows: run in parallel)");
    TORCH_CHECK(f[x] <= f[x + 1], "starts: not decreasing");
    out.r0.push_back(r0), out.r1.push_back(r1), out.first.push_back(f[x]);
    out.tallest = std::max(out.tallest, n);
    for (int64_t t = f[x]; t < f[x + 1]; ++t) {
      const int64_t j0 = s[2 * t], j1 = s[2 * t + 1];
      TORCH_CHECK(0 <= j0 && j0 <= j1 && j1 <= Lk, "a tile's keys lie in [0, Lk)");
      const c10::optional<at::Tensor> a = allowed.get(t), b = bias.get(t);
      for (const auto* part : {&a, &b}) {
        if (!part->has_value() || !(*part)->defined()) continue;
        const at::Tensor& p = **part;
        TORCH_CHECK(p.dim() == 4 && (p.size(0) == B || p.size(0) == 1) && (p.size(1) == H || p.size(1) == 1) &&
                        p.size(2) == n && p.size(3) == j1 - j0,
                    "a tile's mask: (B|1, H|1, n, c)");
      }
      TORCH_CHECK(!a.has_value() || !a->defined() || a->scalar_type() == at::kBool, "allowed: bool");
      TORCH_CHECK(!b.has_value() || !b->defined() || b->scalar_type() == at::kFloat, "bias: float32");
      out.j0.push_back(j0), out.j1.push_back(j1);
      out.allowed.push_back(Part<bool>::of(a));
      out.bias.push_back(Part<float>::of(b));
      out.widest = std::max(out.widest, j1 - j0);
    }
  }
  out.first.push_back(T);
  return out;
}

// A bias on the distance: rel (B|1, H|1, R), f(b, h, d) at u = d - d0, for d = q_idx - kv_idx: pair (query p,
// key j) reads u = p - j - d0.
struct Distance {
  const float* data = nullptr;
  int64_t sb = 0, sh = 0, R = 0, d0 = 0;

  static Distance of(const c10::optional<at::Tensor>& rel, int64_t d0, int64_t B, int64_t H) {
    Distance d;
    if (!rel.has_value() || !rel->defined()) return d;
    const at::Tensor& t = *rel;
    TORCH_CHECK(t.dim() == 3 && (t.size(0) == B || t.size(0) == 1) && (t.size(1) == H || t.size(1) == 1) &&
                    t.stride(2) == 1 && t.scalar_type() == at::kFloat,
                "rel: (B|1, H|1, R) float32, its last dimension contiguous");
    d.data = t.data_ptr<float>(), d.R = t.size(2), d.d0 = d0;
    d.sb = t.size(0) == 1 ? 0 : t.stride(0), d.sh = t.size(1) == 1 ? 0 : t.stride(1);
    return d;
  }
  // Every pair of every block's rows and tiles reads a distance in [0, R).
  void check(const Plan& P) const {
    if (data == nullptr) return;
    for (int64_t x = 0; x < P.blocks(); ++x) {
      for (int64_t t = P.first[x]; t < P.first[x + 1]; ++t) {
        if (P.j1[t] == P.j0[t] || P.r1[x] == P.r0[x]) continue;
        TORCH_CHECK(P.r0[x] - (P.j1[t] - 1) - d0 >= 0 && P.r1[x] - 1 - P.j0[t] - d0 < R,
                    "rel: a tile's distances lie in [0, R)");
      }
    }
  }
  // The row of (b, h) at query p and the tile's first key j0: read backwards, element j at [-j].
  const float* row(int64_t b, int64_t h, int64_t p, int64_t j0) const {
    return data == nullptr ? nullptr : data + b * sb + h * sh + p - j0 - d0;
  }
};

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim && t.is_contiguous() && t.scalar_type() == at::kFloat, name,
              ": a contiguous float32 tensor of ", dim, " dimensions");
}

// q, k, v, out and dout come in float32, or all in bfloat16 (`raw`) where the products are in bfloat16 (`low`) and
// every key and value is finite (no `guard`, whose products read float32 values): the packing for the products then
// reads them as they are, and out is written rounded to bfloat16, without float32 copies of any of them.
bool raw_inputs(std::initializer_list<std::pair<const at::Tensor*, const char*>> ts, bool low, bool guard) {
  const bool raw = ts.begin()->first->scalar_type() == at::kBFloat16;
  for (const auto& [t, name] : ts) {
    TORCH_CHECK(t->dim() == 4 && t->is_contiguous() && t->scalar_type() == (raw ? at::kBFloat16 : at::kFloat), name,
                ": a contiguous tensor of 4 dimensions, float32, or bfloat16 as q is");
  }
  TORCH_CHECK(!raw || (low && !guard), "bfloat16 inputs: only with low (and the CPU's bfloat16 products), not guard");
  return raw;
}

// A tensor's data as the packing reads it: float32's, or bfloat16's bits.
template <typename S>
const S* data(const at::Tensor& t) {
  if constexpr (std::is_same_v<S, uint16_t>) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
  } else {
    return t.data_ptr<float>();
  }
}

// The modified, masked scores of row i of a tile, in place: s (c,) the raw products; g (c,), where not null, the
// score_mod's derivative (1 - tanh^2); rel, where not null, the distance bias of key j at rel[-j]; returns the
// row's largest.
inline float modify(float* s, float* g, int64_t c, float scale, float cap, const float* rel, const bool* allowed,
                    int64_t aj, const float* bias, int64_t bj) {
  if (cap > 0) {
    const float inv = 1.0f / cap;
    if (g != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) {
        const float t = fast_tanh(s[j] * scale * inv);
        s[j] = cap * t;
        g[j] = 1.0f - t * t;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < c; ++j) s[j] = cap * fast_tanh(s[j] * scale * inv);
    }
  } else if (rel != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) s[j] = s[j] * scale + rel[-j];
  } else {
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) s[j] *= scale;
  }
  if (bias != nullptr) {
    for (int64_t j = 0; j < c; ++j) s[j] += bias[j * bj];
  }
  if (allowed != nullptr) {
    for (int64_t j = 0; j < c; ++j) s[j] = allowed[j * aj] ? s[j] : -INF;
  }
  return attnkit::largest(s, c);
}

// C (n, d) += alpha A X over the pairs (i, j) not hidden (hidden (n, c) marks them), A (n, c), X (c, d), A and
// hidden rows ld apart: the product where a key or value that is not finite must not reach a row that may not see it
// (0 * inf is NaN).
void product_of_seen(const float* A, int64_t n, int64_t c, int64_t ld, const uint8_t* hidden, const float* X,
                     int64_t d, float alpha, float* C) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = C + i * d;
    for (int64_t j = 0; j < c; ++j) {
      if (hidden[i * ld + j]) continue;
      const float a = alpha * A[i * ld + j];
      const float* x = X + j * d;
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) row[e] += a * x[e];
    }
  }
}

// A piece of a tile to compute: rows [i0, i1), and the columns [lo, hi) some row among them may see.
struct Piece {
  int64_t i0, i1, lo, hi;
};

// Rows of a masked tile computed together: the products skip the columns none of them may see (most of the hidden
// half of a causal diagonal or a window's edge), in products that stay large enough to run near the BLAS's rate.
constexpr int64_t SUB = 64;

// The pieces of tile (b, h) of n rows and c columns: the whole tile without a mask; with one, each SUB rows over the
// columns their masks show (none where they show nothing).
void pieces_of(const Part<bool>& al, int64_t b, int64_t h, int64_t n, int64_t c, std::vector<Piece>& out) {
  out.clear();
  if (al.data == nullptr) {
    out.push_back({0, n, 0, c});
    return;
  }
  for (int64_t i0 = 0; i0 < n; i0 += SUB) {
    const int64_t i1 = std::min(i0 + SUB, n);
    int64_t lo = c, hi = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const bool* ar = al.at(b, h, i);
      for (int64_t j = 0; j < lo; ++j) {
        if (ar[j * al.sj]) {
          lo = j;
          break;
        }
      }
      for (int64_t j = c - 1; j >= hi; --j) {
        if (ar[j * al.sj]) {
          hi = j + 1;
          break;
        }
      }
    }
    if (lo < hi) out.push_back({i0, i1, lo, hi});
  }
}

// Runs fn(allowed, bias, c, i0, i1, lo, w, k0) on each piece of each tile of block blk for (example b, head h), n
// rows: the tile's c keys from its first, the piece's rows [i0, i1) and columns [lo, lo + w), keys [k0, k0 + w).
template <typename Fn>
void each_piece(const Plan& P, int64_t blk, int64_t b, int64_t h, int64_t n, std::vector<Piece>& pieces, Fn&& fn) {
  for (int64_t t = P.first[blk]; t < P.first[blk + 1]; ++t) {
    const int64_t j0 = P.j0[t], c = P.j1[t] - j0;
    if (c == 0) continue;
    pieces_of(P.allowed[t], b, h, n, c, pieces);
    for (const Piece& pc : pieces) fn(P.allowed[t], P.bias[t], c, pc.i0, pc.i1, pc.lo, pc.hi - pc.lo, j0 + pc.lo);
  }
}

// Forward: out (B, H, Lq, Dv) and lse (B, H, Lq) of q (B, H, Lq, D) over the tiles of k (B, H, Lk, D), v (B, H,
// Lk, Dv), written in place in the rows of the plan's blocks (the other rows are left as they are); sink (B, H, Lq)
// the sink's logit per row, or None. Each (example, head) of each block runs apart: parallel over all of them.
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
             const at::Tensor& starts, const at::Tensor& spans, const c10::List<c10::optional<at::Tensor>>& allowed,
             const c10::List<c10::optional<at::Tensor>>& bias, const c10::optional<at::Tensor>& sink,
             const c10::optional<at::Tensor>& rel, int64_t d0, double scale_, double cap_, bool guard, bool low_,
             at::Tensor out, at::Tensor lse) {
  const bool low = low_ && attnkit::bf16::available();
  const bool raw = raw_inputs({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}}, low, guard);
  check(lse, "lse", 3);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.size(0) == B && v.size(1) == H &&
                  v.size(2) == Lk,
              "q, k, v: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv)");
  TORCH_CHECK(out.size(0) == B && out.size(1) == H && out.size(2) == Lq && out.size(3) == Dv, "out: (B, H, Lq, Dv)");
  TORCH_CHECK(lse.size(0) == B && lse.size(1) == H && lse.size(2) == Lq, "lse: (B, H, Lq)");
  const Plan P = plan_of(rows, starts, spans, allowed, bias, B, H, Lq, Lk);
  const Distance dist = Distance::of(rel, d0, B, H);
  dist.check(P);
  TORCH_CHECK(dist.data == nullptr || cap_ == 0, "a distance bias or a cap, not both");
  const bool has_sink = sink.has_value() && sink->defined();
  if (has_sink) {
    check(*sink, "sink", 3);
    TORCH_CHECK(sink->size(0) == B && sink->size(1) == H && sink->size(2) == Lq, "sink: (B, H, Lq)");
  }
  const float scale = static_cast<float>(scale_), cap = static_cast<float>(cap_);
  const int64_t c_max = std::max<int64_t>(P.widest, 1), n_max = P.tallest, NB = P.blocks();
  const float* sink_data = has_sink ? sink->data_ptr<float>() : nullptr;
  // bfloat16 inputs (as they are with `raw`, else in float32, exactly), where the CPU has its dot products: the
  // products in bfloat16 with float32 sums (the weights rounded to bfloat16 for p v, as FlashAttention's), the
  // softmax in float32. Each (example, head) packed once: q's rows (Lq, De), k for q k^T (D2, Lk, 2), v for p v
  // (Lk2, Dv, 2) (bf16.h).
  const int64_t De = attnkit::bf16::even(D), D2 = De / 2, Lk2 = (Lk + 1) / 2;
  // (left uninitialized: every element is written by the packing below, in parallel, before it is read)
  std::unique_ptr<uint16_t[]> qb_(new uint16_t[low ? B * H * Lq * De : 0]),
      kt_(new uint16_t[low ? B * H * D2 * Lk * 2 : 0]), vr_(new uint16_t[low ? B * H * Lk2 * Dv * 2 : 0]);
  uint16_t *qb = qb_.get(), *kt = kt_.get(), *vr = vr_.get();
  auto pack = [&](auto source) {  // (source: float or uint16_t, the inputs' type)
    using S = decltype(source);
    const S *qd = data<S>(q), *kd = data<S>(k), *vd = data<S>(v);
    at::parallel_for(0, B * H, 1, [&](int64_t a0, int64_t a1) {
      for (int64_t a = a0; a < a1; ++a) {
        attnkit::bf16::rows(qd + a * Lq * D, Lq, D, D, 0, qb + a * Lq * De, De);
        attnkit::bf16::pack_columns(kd + a * Lk * D, Lk, D, D, kt + a * D2 * Lk * 2);
        attnkit::bf16::pack_rows(vd + a * Lk * Dv, Lk, Dv, Dv, vr + a * Lk2 * Dv * 2);
      }
    });
  };
  if (raw) {
    pack(uint16_t{});
  } else if (low) {
    pack(float{});
  }
  at::parallel_for(0, B * H * NB, 1, [&](int64_t x0, int64_t x1) {
    std::vector<float> s(n_max * c_max), acc(n_max * Dv), m(n_max), l(n_max);
    std::vector<uint8_t> hidden(guard ? n_max * c_max : 0);
    std::vector<uint16_t> pb(low ? n_max * (c_max + 2) : 0);  // a tile's weights, in bfloat16
    std::vector<Piece> pieces;
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t a = x / NB, blk = x % NB, b = a / H, h = a % H;
      const int64_t r0 = P.r0[blk], n = P.r1[blk] - r0;
      // (float32 inputs: read by the products in float32 and by guard's; bfloat16 ones only through the packing)
      const float* qa = raw ? nullptr : q.data_ptr<float>() + (a * Lq + r0) * D;
      const float* ka = raw ? nullptr : k.data_ptr<float>() + a * Lk * D;
      const float* va = raw ? nullptr : v.data_ptr<float>() + a * Lk * Dv;
      std::fill(acc.begin(), acc.begin() + n * Dv, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        m[i] = has_sink ? sink_data[a * Lq + r0 + i] : -INF;
        l[i] = has_sink ? 1.0f : 0.0f;
      }
      // rows [i0, i1) x keys [k0, k0 + w) of a tile of c keys, its columns [lo, lo + w): its scores at s[i, lo + j]
      each_piece(P, blk, b, h, n, pieces, [&](const Part<bool>& al, const Part<float>& bi, int64_t c, int64_t i0,
                                               int64_t i1, int64_t lo, int64_t w, int64_t k0) {
        const int64_t rows_ = i1 - i0;
        float* sp = s.data() + i0 * c + lo;
        if (low) {  // (rows, w) q k^T
          attnkit::bf16::mm(rows_, w, D2, 1.0f, qb + (a * Lq + r0 + i0) * De, De,
                            kt + a * D2 * Lk * 2 + k0 * 2, Lk, false, sp, c);
        } else {
          mm(false, true, rows_, w, D, 1.0f, qa + i0 * D, D, ka + k0 * D, D, 0.0f, sp, c);  // (rows, w) q k^T
        }
        for (int64_t i = i0; i < i1; ++i) {
          float* row = s.data() + i * c + lo;
          const float top = modify(row, nullptr, w, scale, cap, dist.row(b, h, r0 + i, k0),
                                   al.data ? al.at(b, h, i) + lo * al.sj : nullptr, al.sj,
                                   bi.data ? bi.at(b, h, i) + lo * bi.sj : nullptr, bi.sj);
          if (guard) {
            for (int64_t j = 0; j < w; ++j) hidden[i * c + lo + j] = row[j] == -INF;
          }
          const float m_new = std::max(m[i], top);  // -inf where the row saw nothing yet
          const float m_safe = m_new == -INF ? 0.0f : m_new;
          const float alpha = fast_exp(m[i] - m_safe);
          m[i] = m_new;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < w; ++j) {
            row[j] = fast_exp(row[j] - m_safe);
            sum += row[j];
          }
          l[i] = l[i] * alpha + sum;
          if (alpha != 1.0f) {
            float* o = acc.data() + i * Dv;
            for (int64_t d = 0; d < Dv; ++d) o[d] *= alpha;
          }
        }
        float* ap = acc.data() + i0 * Dv;
        if (guard) {  // (rows, Dv) += p v
          product_of_seen(sp, rows_, w, c, hidden.data() + i0 * c + lo, va + k0 * Dv, Dv, 1.0f, ap);
        } else if (low) {  // (rows, Dv) += p v, the pairs of keys from the even key at or before k0
          // (the output's weights rounded to bfloat16; the backward takes its rows' delta from the float32 weights it
          // recomputes, not from this output: below)
          const int64_t lead = k0 & 1, wa = attnkit::bf16::even(lead + w);
          const uint16_t* vt = vr + (a * Lk2 + (k0 - lead) / 2) * Dv * 2;
          attnkit::bf16::rows(sp, rows_, w, c, lead, pb.data(), wa);  // (rows, wa)
          attnkit::bf16::mm(rows_, Dv, wa / 2, 1.0f, pb.data(), wa, vt, Dv, true, ap, Dv);
        } else {
          mm(false, false, rows_, Dv, w, 1.0f, sp, c, va + k0 * Dv, Dv, 1.0f, ap, Dv);  // (rows, Dv) += p v
        }
      });
      float* la = lse.data_ptr<float>() + a * Lq + r0;
      // the output in float32, or with `raw` rounded once to bfloat16
      float* oa = raw ? nullptr : out.data_ptr<float>() + (a * Lq + r0) * Dv;
      uint16_t* ob = raw ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + (a * Lq + r0) * Dv : nullptr;
      for (int64_t i = 0; i < n; ++i) {
        const bool empty = l[i] == 0.0f;
        const float li = std::max(l[i], std::numeric_limits<float>::min());
        const float* o = acc.data() + i * Dv;
        if (raw) {
          for (int64_t d = 0; d < Dv; ++d) ob[i * Dv + d] = attnkit::bf16::round(empty ? 0.0f : o[d] / li);
        } else {
          for (int64_t d = 0; d < Dv; ++d) oa[i * Dv + d] = empty ? 0.0f : o[d] / li;
        }
        la[i] = empty ? -INF : m[i] + std::log(li);  // (-inf: no key; the backward gives such a row no weight)
      }
    }
  });
}

// Backward: dq (B, H, Lq, D) written in the rows of the plan's blocks, and their share of dk (B, H, Lk, D) and dv
// (B, H, Lk, Dv) added in place, from out and dout (B, H, Lq, Dv) and lse (B, H, Lq); with a distance bias, its
// gradient added to drel (B, H, R) float64 (each distance sums up to a row's worth of pairs per block: kept in
// float64). Parallel over (example, head): the blocks of one add to the same keys' gradients.
void backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& rows, const at::Tensor& starts,
              const at::Tensor& spans, const c10::List<c10::optional<at::Tensor>>& allowed,
              const c10::List<c10::optional<at::Tensor>>& bias, const c10::optional<at::Tensor>& rel, int64_t d0,
              double scale_, double cap_, bool guard, bool low_, const c10::optional<at::Tensor>& dlse, at::Tensor dq,
              at::Tensor dk, at::Tensor dv, at::Tensor drel, at::Tensor rowsum) {
  const bool low = low_ && attnkit::bf16::available();
  const bool raw = raw_inputs({{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"}}, low, guard);
  check(lse, "lse", 3), check(dq, "dq", 4), check(dk, "dk", 4), check(dv, "dv", 4);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(dq.sizes() == q.sizes() && dk.sizes() == k.sizes() && dv.sizes() == v.sizes(), "dq, dk, dv as q, k, v");
  TORCH_CHECK(out.size(0) == B && out.size(1) == H && out.size(2) == Lq && out.size(3) == Dv &&
                  dout.sizes() == out.sizes(),
              "out, dout: (B, H, Lq, Dv)");
  TORCH_CHECK(lse.size(0) == B && lse.size(1) == H && lse.size(2) == Lq, "lse: (B, H, Lq)");
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D && v.size(0) == B && v.size(1) == H &&
                  v.size(2) == Lk,
              "q, k, v: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv)");
  const Plan P = plan_of(rows, starts, spans, allowed, bias, B, H, Lq, Lk);
  const Distance dist = Distance::of(rel, d0, B, H);
  dist.check(P);
  TORCH_CHECK(dist.data == nullptr || cap_ == 0, "a distance bias or a cap, not both");
  TORCH_CHECK(dist.data == nullptr || (drel.dim() == 3 && drel.size(0) == B && drel.size(1) == H &&
                                       drel.size(2) == dist.R && drel.is_contiguous() &&
                                       drel.scalar_type() == at::kDouble),
              "drel: (B, H, R) float64, contiguous");
  const float scale = static_cast<float>(scale_), cap = static_cast<float>(cap_);
  const int64_t c_max = std::max<int64_t>(P.widest, 1), n_max = P.tallest, NB = P.blocks();
  // bfloat16 products as the forward's (there), each from the layout bf16.h reads: per (example, head), q's and
  // dout's rows (Lq, De | Dve), k for q k^T (kp: D2, Lk, 2) and for ds k (kr: Lk2, D, 2), v for dout v^T (vp: Dv2,
  // Lk, 2); per block, q^T and dout^T (D | Dv, ne); a tile's ds, or its p or ds packed over pairs of rows, in pb.
  // dk and dv are summed transposed, dk^T (D, Lk) and dv^T (Dv, Lk) = q^T ds and dout^T p, whose B side is the
  // tile packed two rows at a time (where dk = ds^T q would transpose each tile), and added to dk and dv once a head.
  // A row's delta, sum_j p_ij dp_ij (- dlse_i), is summed from the float32 weights recomputed here, not taken as
  // dout . out: the forward's output came from weights rounded to bfloat16, and a delta that misses the weights'
  // own sum by that rounding leaves each row's ds a sum, which the gradients of sinks and of a distance bias (ALiBi's
  // slopes) add up (10x the bfloat16 math's error: the tester's finding). So each 64 rows of a block run twice over
  // their tiles: the weights and dp kept (chunk buffers, SUB x the block's keys), delta summed; then the products.
  // The rows' deltas go to rowsum (B, H, Lq), for the sinks' gradient. bfloat16 inputs (`raw`) are packed as they
  // are.
  const int64_t De = attnkit::bf16::even(D), Dve = attnkit::bf16::even(Dv), Lk2 = (Lk + 1) / 2;
  const int64_t ne = attnkit::bf16::even(n_max);
  int64_t row_keys = 1;  // the most keys a block's tiles hold in all
  for (int64_t x = 0; x < NB; ++x) {
    int64_t sum = 0;
    for (int64_t t = P.first[x]; t < P.first[x + 1]; ++t) sum += P.j1[t] - P.j0[t];
    row_keys = std::max(row_keys, sum);
  }
  const bool has_dlse = dlse.has_value() && dlse->defined();
  if (low) {
    TORCH_CHECK(rowsum.dim() == 3 && rowsum.size(0) == B && rowsum.size(1) == H && rowsum.size(2) == Lq &&
                    rowsum.is_contiguous() && rowsum.scalar_type() == at::kFloat,
                "rowsum: (B, H, Lq) float32, contiguous");
    if (has_dlse) check(*dlse, "dlse", 3);
  }
  at::parallel_for(0, B * H, 1, [&](int64_t a0, int64_t a1) {
    std::vector<float> p(n_max * c_max), g(cap > 0 ? n_max * c_max : 0), dp(n_max * c_max), delta(n_max);
    std::vector<uint8_t> hidden(guard ? n_max * c_max : 0);
    std::vector<uint16_t> qb(low ? Lq * De : 0), ob(low ? Lq * Dve : 0), kp(low ? De * Lk : 0),
        kr(low ? Lk2 * D * 2 : 0), vp(low ? Dve * Lk : 0), qt(low ? D * ne : 0), ot(low ? Dv * ne : 0),
        pb(low ? (n_max + 1) * (c_max + 2) : 0);
    std::vector<float> dkt(low ? D * Lk : 0), dvt(low ? Dv * Lk : 0);
    std::vector<float> cp(low ? SUB * row_keys : 0), cdp(low ? SUB * row_keys : 0), cg(low && cap > 0 ? SUB * row_keys : 0);
    std::vector<uint8_t> ch(low && guard ? SUB * row_keys : 0);
    struct Job {
      int64_t t, c, i0, i1, lo, w;
    };
    std::vector<Job> jobs;
    std::vector<Piece> pieces;
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t b = a / H, h = a % H;
      // (float32 inputs: read by the products in float32 and by guard's; bfloat16 ones only through the packing)
      const float* ka = raw ? nullptr : k.data_ptr<float>() + a * Lk * D;
      const float* va = raw ? nullptr : v.data_ptr<float>() + a * Lk * Dv;
      float* dka = dk.data_ptr<float>() + a * Lk * D;
      float* dva = dv.data_ptr<float>() + a * Lk * Dv;
      auto pack_head = [&](auto source) {  // (source: float or uint16_t, the inputs' type)
        using S = decltype(source);
        const S *kd = data<S>(k) + a * Lk * D, *vd = data<S>(v) + a * Lk * Dv;
        attnkit::bf16::rows(data<S>(q) + a * Lq * D, Lq, D, D, 0, qb.data(), De);
        attnkit::bf16::rows(data<S>(dout) + a * Lq * Dv, Lq, Dv, Dv, 0, ob.data(), Dve);
        attnkit::bf16::pack_columns(kd, Lk, D, D, kp.data());
        attnkit::bf16::pack_rows(kd, Lk, D, D, kr.data());
        attnkit::bf16::pack_columns(vd, Lk, Dv, Dv, vp.data());
      };
      if (low) {
        raw ? pack_head(uint16_t{}) : pack_head(float{});
        std::fill(dkt.begin(), dkt.end(), 0.0f);
        std::fill(dvt.begin(), dvt.end(), 0.0f);
      }
      for (int64_t blk = 0; blk < NB; ++blk) {
        const int64_t r0 = P.r0[blk], n = P.r1[blk] - r0;
        const float* qa = raw ? nullptr : q.data_ptr<float>() + (a * Lq + r0) * D;
        const float* oa = raw ? nullptr : dout.data_ptr<float>() + (a * Lq + r0) * Dv;
        auto pack_block = [&](auto source) {
          using S = decltype(source);
          attnkit::bf16::transposed(data<S>(q) + (a * Lq + r0) * D, n, D, D, qt.data(), ne);  // (D, ne) q^T
          attnkit::bf16::transposed(data<S>(dout) + (a * Lq + r0) * Dv, n, Dv, Dv, ot.data(), ne);  // (Dv, ne)
        };
        if (low) raw ? pack_block(uint16_t{}) : pack_block(float{});
        const float* outa = raw ? nullptr : out.data_ptr<float>() + (a * Lq + r0) * Dv;
        const float* la = lse.data_ptr<float>() + a * Lq + r0;
        float* dqa = dq.data_ptr<float>() + (a * Lq + r0) * D;
        std::fill(dqa, dqa + n * D, 0.0f);
        if (low) {
          jobs.clear();  // the block's pieces, found once
          for (int64_t t = P.first[blk]; t < P.first[blk + 1]; ++t) {
            const int64_t c = P.j1[t] - P.j0[t];
            if (c == 0) continue;
            pieces_of(P.allowed[t], b, h, n, c, pieces);
            for (const Piece& pc : pieces) jobs.push_back({t, c, pc.i0, pc.i1, pc.lo, pc.hi - pc.lo});
          }
          const float* dl = has_dlse ? dlse->data_ptr<float>() + a * Lq + r0 : nullptr;
          float* rs = rowsum.data_ptr<float>() + a * Lq + r0;
          for (int64_t r = 0; r < n; r += SUB) {
            const int64_t r1 = std::min(r + SUB, n);
            for (int64_t i = r; i < r1; ++i) delta[i] = dl != nullptr ? -dl[i] : 0.0f;
            for (int pass = 0; pass < 2; ++pass) {
              int64_t base = 0;  // where a piece's rows x columns sit in the chunk buffers, rows w apart
              for (const Job& job : jobs) {
                const int64_t i0 = std::max(job.i0, r), i1 = std::min(job.i1, r1), w = job.w;
                if (i0 >= i1) continue;
                const int64_t rows_ = i1 - i0, k0 = P.j0[job.t] + job.lo, lo = job.lo;
                const Part<bool>& al = P.allowed[job.t];
                const Part<float>& bi = P.bias[job.t];
                float* pp = cp.data() + base;  // (rows, w): the weights, then ds
                float* dpp = cdp.data() + base;  // (rows, w): dp
                float* gp = cap > 0 ? cg.data() + base : nullptr;
                uint8_t* hp = guard ? ch.data() + base : nullptr;
                base += rows_ * w;
                if (pass == 0) {  // the weights and dp, and each row's delta
                  attnkit::bf16::mm(rows_, w, De / 2, 1.0f, qb.data() + (r0 + i0) * De, De, kp.data() + k0 * 2, Lk,
                                    false, pp, w);  // (rows, w) q k^T
                  for (int64_t i = i0; i < i1; ++i) {
                    float* row = pp + (i - i0) * w;
                    modify(row, gp != nullptr ? gp + (i - i0) * w : nullptr, w, scale, cap, dist.row(b, h, r0 + i, k0),
                           al.data ? al.at(b, h, i) + lo * al.sj : nullptr, al.sj,
                           bi.data ? bi.at(b, h, i) + lo * bi.sj : nullptr, bi.sj);
                    const float shift = la[i];
                    if (hp != nullptr) {
                      for (int64_t j = 0; j < w; ++j) hp[(i - i0) * w + j] = row[j] == -INF;
                    }
#pragma omp simd
                    for (int64_t j = 0; j < w; ++j) row[j] = row[j] == -INF ? 0.0f : fast_exp(row[j] - shift);
                  }
                  attnkit::bf16::mm(rows_, w, Dve / 2, 1.0f, ob.data() + (r0 + i0) * Dve, Dve, vp.data() + k0 * 2, Lk,
                                    false, dpp, w);  // (rows, w) dout v^T
                  for (int64_t i = i0; i < i1; ++i) {  // (a hidden pair weighs 0, whatever dp holds there: inf, NaN)
                    const float* pr = pp + (i - i0) * w;
                    const float* dr = dpp + (i - i0) * w;
                    float e = 0.0f;
                    for (int64_t j = 0; j < w; ++j) e += pr[j] != 0.0f ? pr[j] * dr[j] : 0.0f;
                    delta[i] += e;
                  }
                  continue;
                }
                const int64_t re = attnkit::bf16::even(rows_);
                attnkit::bf16::pack_rows(pp, rows_, w, w, pb.data());  // (re / 2, w, 2) p
                attnkit::bf16::mm(Dv, w, re / 2, 1.0f, ot.data() + i0, ne, pb.data(), w, true, dvt.data() + k0,
                                  Lk);  // (Dv, w) += dout^T p
                for (int64_t i = i0; i < i1; ++i) {
                  float* pr = pp + (i - i0) * w;
                  const float* dr = dpp + (i - i0) * w;
                  const float e = delta[i];
                  if (gp != nullptr) {
                    const float* gr = gp + (i - i0) * w;
#pragma omp simd
                    for (int64_t j = 0; j < w; ++j) pr[j] = pr[j] * (dr[j] - e) * gr[j];
                  } else {
#pragma omp simd
                    for (int64_t j = 0; j < w; ++j) pr[j] = pr[j] * (dr[j] - e);
                  }
                  if (hp != nullptr) {
                    for (int64_t j = 0; j < w; ++j) pr[j] = hp[(i - i0) * w + j] ? 0.0f : pr[j];
                  } else if (al.data != nullptr) {
                    const bool* ar = al.at(b, h, i) + lo * al.sj;
                    for (int64_t j = 0; j < w; ++j) pr[j] = ar[j * al.sj] ? pr[j] : 0.0f;
                  }
                  if (dist.data != nullptr) {
                    double* du = drel.data_ptr<double>() + a * dist.R + (r0 + i) - k0 - dist.d0;
#pragma omp simd
                    for (int64_t j = 0; j < w; ++j) du[-j] += pr[j];
                  }
                }
                float* dqp = dqa + i0 * D;
                if (hp != nullptr) {  // (rows, D) += ds k over the pairs seen
                  product_of_seen(pp, rows_, w, w, hp, ka + k0 * D, D, scale, dqp);
                } else {  // (rows, D) += ds k, the pairs of keys from the even key at or before k0
                  const int64_t lead = k0 & 1, wa = attnkit::bf16::even(lead + w);
                  attnkit::bf16::rows(pp, rows_, w, w, lead, pb.data(), wa);  // (rows, wa)
                  attnkit::bf16::mm(rows_, D, wa / 2, scale, pb.data(), wa, kr.data() + (k0 - lead) / 2 * D * 2, D,
                                    true, dqp, D);
                }
                attnkit::bf16::pack_rows(pp, rows_, w, w, pb.data());  // (re / 2, w, 2) ds
                attnkit::bf16::mm(D, w, re / 2, scale, qt.data() + i0, ne, pb.data(), w, true, dkt.data() + k0,
                                  Lk);  // (D, w) += q^T ds
              }
            }
            for (int64_t i = r; i < r1; ++i) rs[i] = delta[i];
          }
          continue;
        }
        for (int64_t i = 0; i < n; ++i) {  // sum_j p_ij dp_ij = dout_i . out_i, the softmax Jacobian's row term
          float e = 0.0f;
#pragma omp simd reduction(+ : e)
          for (int64_t d = 0; d < Dv; ++d) e += oa[i * Dv + d] * outa[i * Dv + d];
          delta[i] = e;
        }
        // rows [i0, i1) x keys [k0, k0 + w) of a tile of c keys, its columns [lo, lo + w): at p[i, lo + j]
        each_piece(P, blk, b, h, n, pieces, [&](const Part<bool>& al, const Part<float>& bi, int64_t c, int64_t i0,
                                                 int64_t i1, int64_t lo, int64_t w, int64_t k0) {
          const int64_t rows_ = i1 - i0;
          float* pp = p.data() + i0 * c + lo;
          float* dpp = dp.data() + i0 * c + lo;
          mm(false, true, rows_, w, D, 1.0f, qa + i0 * D, D, ka + k0 * D, D, 0.0f, pp, c);  // (rows, w) q k^T
          for (int64_t i = i0; i < i1; ++i) {
            float* row = p.data() + i * c + lo;
            modify(row, cap > 0 ? g.data() + i * c + lo : nullptr, w, scale, cap, dist.row(b, h, r0 + i, k0),
                   al.data ? al.at(b, h, i) + lo * al.sj : nullptr, al.sj,
                   bi.data ? bi.at(b, h, i) + lo * bi.sj : nullptr, bi.sj);
            const float shift = la[i];
            if (guard) {
              for (int64_t j = 0; j < w; ++j) hidden[i * c + lo + j] = row[j] == -INF;
            }
#pragma omp simd
            for (int64_t j = 0; j < w; ++j) {  // the weights again; 0 where hidden, whatever the row's lse (NaN)
              row[j] = row[j] == -INF ? 0.0f : fast_exp(row[j] - shift);
            }
          }
          const float* kt = ka + k0 * D;
          const float* vt = va + k0 * Dv;
          const float* op = oa + i0 * Dv;
          mm(true, false, w, Dv, rows_, 1.0f, pp, c, op, Dv, 1.0f, dva + k0 * Dv, Dv);  // (w, Dv) += p^T dout
          mm(false, true, rows_, w, Dv, 1.0f, op, Dv, vt, Dv, 0.0f, dpp, c);  // (rows, w) dout v^T
          for (int64_t i = i0; i < i1; ++i) {
            float* pr = p.data() + i * c + lo;
            const float* dr = dp.data() + i * c + lo;
            const float e = delta[i];
            if (cap > 0) {
              const float* gr = g.data() + i * c + lo;
#pragma omp simd
              for (int64_t j = 0; j < w; ++j) pr[j] = pr[j] * (dr[j] - e) * gr[j];
            } else {
#pragma omp simd
              for (int64_t j = 0; j < w; ++j) pr[j] = pr[j] * (dr[j] - e);
            }
            // the gradient of a hidden score is 0 (as FlexAttention's: a score_mod singular where it hides has none)
            if (guard) {
              for (int64_t j = 0; j < w; ++j) pr[j] = hidden[i * c + lo + j] ? 0.0f : pr[j];
            } else if (al.data != nullptr) {
              const bool* ar = al.at(b, h, i) + lo * al.sj;
              for (int64_t j = 0; j < w; ++j) pr[j] = ar[j * al.sj] ? pr[j] : 0.0f;
            }
            if (dist.data != nullptr) {  // d score / d f = 1: the bias at distance u gets the scores' gradients
              double* du = drel.data_ptr<double>() + a * dist.R + (r0 + i) - k0 - dist.d0;
#pragma omp simd
              for (int64_t j = 0; j < w; ++j) du[-j] += pr[j];
            }
          }
          float* dqp = dqa + i0 * D;
          if (guard) {  // (dp is not finite where a hidden value is not: ds is 0 there, and k's hidden keys skipped)
            product_of_seen(pp, rows_, w, c, hidden.data() + i0 * c + lo, kt, D, scale, dqp);  // (rows, D) += ds k
          } else {
            mm(false, false, rows_, D, w, scale, pp, c, kt, D, 1.0f, dqp, D);  // (rows, D) += ds k
          }
          mm(true, false, w, D, rows_, scale, pp, c, qa + i0 * D, D, 1.0f, dka + k0 * D, D);  // (w, D) += ds^T q
        });
      }
      if (low) {  // dk += dk^T's transpose, dv += dv^T's
        for (int64_t j = 0; j < Lk; ++j) {
          for (int64_t d = 0; d < D; ++d) dka[j * D + d] += dkt[d * Lk + j];
          for (int64_t d = 0; d < Dv; ++d) dva[j * Dv + d] += dvt[d * Lk + j];
        }
      }
    }
  });
}

// Whether a call with `low` computes its products in bfloat16 here (bf16.h: the CPU's AVX512-BF16).
bool bf16_products() { return attnkit::bf16::available(); }

}  // namespace

TORCH_LIBRARY(attnkit_flash, m) {
  m.def("bf16_products() -> bool", bf16_products);
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor starts, Tensor spans, Tensor?[] allowed, "
      "Tensor?[] bias, Tensor? sink, Tensor? rel, int d0, float scale, float cap, bool guard, bool low, "
      "Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def(
      "backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse, Tensor rows, Tensor starts, "
      "Tensor spans, Tensor?[] allowed, Tensor?[] bias, Tensor? rel, int d0, float scale, float cap, bool guard, "
      "bool low, Tensor? dlse, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!) drel, Tensor(e!) rowsum) -> ()");
}

TORCH_LIBRARY_IMPL(attnkit_flash, CPU, m) {
  m.impl("forward", forward);
  m.impl("backward", backward);
}
