// Matrix products of bfloat16 inputs into float32 sums, on the CPU's AVX512-BF16 dot products (vdpbf16ps: two
// bf16 products added into each float32 lane, twice the float32 FMA rate), for flash.cpp's bfloat16 calls.
// PyTorch's exported products do not reach that rate here: MKL's gemm_bf16bf16f32 takes its AVX2 path on this
// AMD CPU (1.1-1.26x sgemm's time on the kernel's tiles), oneDNN's brgemm packs only with AMX and runs unpacked at
// sgemm's rate, and mkldnn_matmul writes bfloat16 (measured: docs/benchmarks.md, issue 51).
//
// Layouts. A product C (M, N) = A (M, K) B (K, N) reduces over K in pairs: A holds its rows' values in pairs (row r,
// pair p at A[r * lda + 2p], lda even, a row's length padded to even with 0); B is packed [K2][ldb][2], pair p of
// column j at B[(p * ldb + j) * 2], K2 = ceil(K / 2) (an odd K's last pair ends with 0). Each lane of a vector holds
// one column's pair, and a row's pair is broadcast to every lane.
//
// Where the compiler cannot build these (not x86-64, or not GCC 10+ / Clang 9+), or the CPU lacks AVX512-BF16,
// available() is false and flash.cpp computes in float32.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

// (GCC 10 and Clang 9 brought the AVX512-BF16 intrinsics; an older compiler builds the kernel without them)
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 9) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#include <immintrin.h>
#define ATTNKIT_BF16 1
#define ATTNKIT_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
// (each loop over a tile's registers unrolled, so that its sums stay in registers, not on the stack at every step)
#define UNROLL _Pragma("GCC unroll 8")
#else
#define ATTNKIT_BF16 0
#endif

namespace attnkit::bf16 {

// Whether this CPU computes bfloat16 dot products (and this build can call them).
inline bool available() {
#if ATTNKIT_BF16
  static const bool yes = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
#else
  return false;
#endif
}

// x rounded to the nearest bfloat16 (ties to even); NaN stays NaN, infinities stay infinite.
inline uint16_t round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN, kept quiet
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A value as bfloat16's bits: a float rounded (round), a bfloat16's bits as they are. The packing below reads either:
// float32 inputs, or a call's bfloat16 inputs themselves, without float32 copies.
inline uint16_t bits(float x) { return round(x); }
inline uint16_t bits(uint16_t x) { return x; }

inline int64_t even(int64_t n) { return n + (n & 1); }

// dst (rows, even(lead + w)), rows ldd apart = src (rows, w), rows lds apart, each row shifted right by lead (0 or 1)
// with a 0 in front and one at its end where the length is odd: the A side of a product whose pairs start at an
// even column lead before the source's first.
template <typename S>
#if ATTNKIT_BF16
ATTNKIT_BF16_TARGET
#endif
inline void rows(const S* src, int64_t n, int64_t w, int64_t lds, int64_t lead, uint16_t* dst, int64_t ldd) {
  const int64_t len = even(lead + w);
  for (int64_t i = 0; i < n; ++i) {
    const S* s = src + i * lds;
    uint16_t* d = dst + i * ldd;
    if (lead) d[0] = 0;
    int64_t j = 0;
    if constexpr (std::is_same_v<S, uint16_t>) {
      if (w > 0) std::memcpy(d + lead, s, w * sizeof(uint16_t));  // (an empty tensor's pointer may be null)
      j = w;
    }
#if ATTNKIT_BF16
    if constexpr (std::is_same_v<S, float>) {
      for (; j + 16 <= w; j += 16) {
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + j));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + lead + j), rounded);
      }
    }
#endif
    for (; j < w; ++j) d[lead + j] = bits(s[j]);
    if (lead + w < len) d[len - 1] = 0;
  }
}

// dst (w, even(n)), rows ldd apart = the transpose of src (n, w), rows lds apart, each row ending with 0 where n is
// odd: the A side of a product that reduces over src's rows.
template <typename S>
inline void transposed(const S* src, int64_t n, int64_t w, int64_t lds, uint16_t* dst, int64_t ldd) {
  constexpr int64_t T = 16;  // in squares, so that both sides are read and written a line at a time
  for (int64_t i0 = 0; i0 < n; i0 += T) {
    const int64_t i1 = std::min(i0 + T, n);
    for (int64_t j0 = 0; j0 < w; j0 += T) {
      const int64_t j1 = std::min(j0 + T, w);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) dst[j * ldd + i] = bits(src[i * lds + j]);
      }
    }
  }
  if (n & 1) {
    for (int64_t j = 0; j < w; ++j) dst[j * ldd + n] = 0;
  }
}

// B packed from X (K, N), rows ldx apart, reducing over its rows: out[(p * N + j) * 2 + e] = X[2p + e][j] (0 past K):
// two rows rounded at once and interleaved, 16 columns at a time.
template <typename S>
#if ATTNKIT_BF16
ATTNKIT_BF16_TARGET
#endif
inline void pack_rows(const S* X, int64_t K, int64_t N, int64_t ldx, uint16_t* out) {
#if ATTNKIT_BF16
  static const uint16_t ORDER[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_loadu_si512(ORDER);  // lane 2j: the first row's column j; 2j + 1: the second's
#endif
  for (int64_t p = 0; p < (K + 1) / 2; ++p) {
    const S* x0 = X + 2 * p * ldx;
    const S* x1 = 2 * p + 1 < K ? x0 + ldx : nullptr;
    uint16_t* o = out + p * N * 2;
    int64_t j = 0;
#if ATTNKIT_BF16
    for (; j + 16 <= N; j += 16) {
      __m512i both;  // x0's 16 columns, then x1's
      if constexpr (std::is_same_v<S, float>) {
        const __m512 second = x1 != nullptr ? _mm512_loadu_ps(x1 + j) : _mm512_setzero_ps();
        both = (__m512i)_mm512_cvtne2ps_pbh(second, _mm512_loadu_ps(x0 + j));
      } else {
        const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + j));
        const __m256i second = x1 != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1 + j))
                                             : _mm256_setzero_si256();
        both = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
      }
      _mm512_storeu_si512(o + 2 * j, _mm512_permutexvar_epi16(order, both));
    }
#endif
    for (; j < N; ++j) {
      o[2 * j] = bits(x0[j]);
      o[2 * j + 1] = x1 != nullptr ? bits(x1[j]) : 0;
    }
  }
}

// B packed from the transpose of X (N, K), rows ldx apart, reducing over its columns: out[(p * N + j) * 2 + e] =
// X[j][2p + e] (0 past K). 16 rows at a time, so that each pair's 16 columns are written as one line.
template <typename S>
inline void pack_columns(const S* X, int64_t N, int64_t K, int64_t ldx, uint16_t* out) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t j0 = 0; j0 < N; j0 += 16) {
    const int64_t j1 = std::min(j0 + 16, N);
    for (int64_t p = 0; p < K2; ++p) {
      uint16_t* o = out + (p * N) * 2;
      const bool pair = 2 * p + 1 < K;
      for (int64_t j = j0; j < j1; ++j) {
        const S* x = X + j * ldx + 2 * p;
        o[2 * j] = bits(x[0]);
        o[2 * j + 1] = pair ? bits(x[1]) : 0;
      }
    }
  }
}

#if ATTNKIT_BF16
// R rows x V vectors of 16 columns of C, the last vector's columns those of `last`: R * V float32 sums in registers
// (at most 6 x 4 = 24 of the 32), each pair of A broadcast once per row, each vector of B loaded once per pair.
template <int R, int V>
ATTNKIT_BF16_TARGET inline void tile(int64_t K2, float alpha, const uint16_t* A, int64_t lda, const uint16_t* B,
                                     int64_t ldb, __mmask16 last, bool add, float* C, int64_t ldc) {
  __m512 acc[R][V];
  UNROLL
  for (int r = 0; r < R; ++r) {
    UNROLL
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < K2; ++p) {
    __m512bh b[V];
    UNROLL
    for (int v = 0; v < V; ++v) {
      const __mmask16 m = v == V - 1 ? last : static_cast<__mmask16>(0xffff);
      b[v] = (__m512bh)_mm512_maskz_loadu_epi32(m, B + (p * ldb + 16 * v) * 2);
    }
    UNROLL
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, sizeof pair);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      UNROLL
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
  UNROLL
  for (int r = 0; r < R; ++r) {
    UNROLL
    for (int v = 0; v < V; ++v) {
      const __mmask16 m = v == V - 1 ? last : static_cast<__mmask16>(0xffff);
      float* c = C + r * ldc + 16 * v;
      const __m512 sum =
          add ? _mm512_fmadd_ps(al, acc[r][v], _mm512_maskz_loadu_ps(m, c)) : _mm512_mul_ps(al, acc[r][v]);
      _mm512_mask_storeu_ps(c, m, sum);
    }
  }
}

template <int V>
ATTNKIT_BF16_TARGET inline void rows_of(int64_t M, int64_t K2, float alpha, const uint16_t* A, int64_t lda,
                                        const uint16_t* B, int64_t ldb, __mmask16 last, bool add, float* C,
                                        int64_t ldc) {
  constexpr int R = 6;
  int64_t m = 0;
  for (; m + R <= M; m += R) tile<R, V>(K2, alpha, A + m * lda, lda, B, ldb, last, add, C + m * ldc, ldc);
  switch (M - m) {
    case 5: tile<5, V>(K2, alpha, A + m * lda, lda, B, ldb, last, add, C + m * ldc, ldc); break;
    case 4: tile<4, V>(K2, alpha, A + m * lda, lda, B, ldb, last, add, C + m * ldc, ldc); break;
    case 3: tile<3, V>(K2, alpha, A + m * lda, lda, B, ldb, last, add, C + m * ldc, ldc); break;
    case 2: tile<2, V>(K2, alpha, A + m * lda, lda, B, ldb, last, add, C + m * ldc, ldc); break;
    case 1: tile<1, V>(K2, alpha, A + m * lda, lda, B, ldb, last, add, C + m * ldc, ldc); break;
    default: break;
  }
}
#endif

// C (M, N), rows ldc apart, = alpha A B (+ C where add): A and B in the layouts above, K2 pairs; B's column j at
// B[(p * ldb + j) * 2]. Only where available().
inline void mm(int64_t M, int64_t N, int64_t K2, float alpha, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, bool add, float* C, int64_t ldc) {
#if ATTNKIT_BF16
  if (M == 0 || N == 0) return;
  constexpr int64_t W = 64;  // four vectors of columns at a time
  for (int64_t n0 = 0; n0 < N; n0 += W) {
    const int64_t cols = std::min(W, N - n0);
    const int vectors = static_cast<int>((cols + 15) / 16);
    const int64_t tail = cols - 16 * (vectors - 1);
    const __mmask16 last = static_cast<__mmask16>(tail == 16 ? 0xffff : (1u << tail) - 1u);
    const uint16_t* b = B + n0 * 2;
    float* c = C + n0;
    switch (vectors) {
      case 4: rows_of<4>(M, K2, alpha, A, lda, b, ldb, last, add, c, ldc); break;
      case 3: rows_of<3>(M, K2, alpha, A, lda, b, ldb, last, add, c, ldc); break;
      case 2: rows_of<2>(M, K2, alpha, A, lda, b, ldb, last, add, c, ldc); break;
      default: rows_of<1>(M, K2, alpha, A, lda, b, ldb, last, add, c, ldc); break;
    }
  }
#else
  (void)M, (void)N, (void)K2, (void)alpha, (void)A, (void)lda, (void)B, (void)ldb, (void)add, (void)C, (void)ldc;
#endif
}

}  // namespace attnkit::bf16
