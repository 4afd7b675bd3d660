// What attnkit's C++ kernels share (flash.cpp, stats.cpp): float32 bit casts, the exp() polynomial of both, and a
// row's largest score. Built into each kernel by attnkit/csrc/__init__.py, which hashes this file with the kernel's
// source: a change here builds both again.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace attnkit {

inline float bits_to_float(int32_t i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

inline int32_t float_to_bits(float f) {
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return i;
}

// The largest x for which exp(x) is finite in float32.
constexpr float EXP_HIGHEST = 88.3762626647949f;

// exp(y) for y from a floor of the caller's (a normal result: each kernel says where its floor is and what it does
// below it) up to EXP_HIGHEST: 2^n exp(r), n = round(y / ln 2), |r| <= ln 2 / 2, a degree-7 polynomial for exp(r)
// (Cephes' expf, within 2 units in the last place). n is rounded by adding 1.5 * 2^23 (its bits then hold n): no
// float-to-int conversion, defined for NaN too (whose result stays NaN); branch-free, so that the loops that call
// it vectorize.
inline float exp_polynomial(float y) {
  constexpr float ROUND = 12582912.0f;  // 1.5 * 2^23
  y = std::min(y, EXP_HIGHEST);
  const float shifted = y * 1.44269504088896341f + ROUND;
  const int32_t n_bits = float_to_bits(shifted) - float_to_bits(ROUND);  // n
  const float n = shifted - ROUND;
  float r = y - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_to_float(static_cast<int32_t>(static_cast<uint32_t>(n_bits + 127) << 23));
}

// The largest of x[0, n) (a NaN may or may not win: a row's sum is NaN either way): in lanes, then across them, so
// that the compiler unrolls it as written (one running maximum would wait on each comparison).
inline float largest(const float* x, int64_t n) {
  constexpr int64_t LANES = 16;
  float lanes[LANES];
  for (int64_t l = 0; l < LANES; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    for (int64_t l = 0; l < LANES; ++l) lanes[l] = lanes[l] > x[j + l] ? lanes[l] : x[j + l];
  }
  for (; j < n; ++j) lanes[0] = lanes[0] > x[j] ? lanes[0] : x[j];
  float top = lanes[0];
  for (int64_t l = 1; l < LANES; ++l) top = top > lanes[l] ? top : lanes[l];
  return top;
}

}  // namespace attnkit
