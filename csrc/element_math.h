// Element helpers shared by the element-wise CPU kernels (gelu.cpp, cross_entropy.cpp): fp32 <-> bf16 bits with
// c10::BFloat16's rounding, and an exp for non-positive arguments, all in plain C++ GCC vectorises (the callers'
// loops are compiled per ISA with target_clones).
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The element loops marked MOEZERO_ELEMENT_MULTIVERSION are compiled for AVX-512, AVX2 and the baseline, and the
// loader picks one for this CPU (GNU ifunc).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define MOEZERO_ELEMENT_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MOEZERO_ELEMENT_MULTIVERSION
#endif

namespace moezero {
namespace element {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

template <typename T>
inline float load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return p[i];
  } else {
    return bits_to_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
  }
}

// The bfloat16 bits of f, rounded to nearest even as c10::BFloat16's conversion (NaN becomes the quiet NaN);
// integer selects only, so the loops stay vectorisable.
inline uint16_t bfloat16_bits(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
}

// f rounded to T.
template <typename T>
inline float round_to(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return bits_to_float(static_cast<uint32_t>(bfloat16_bits(f)) << 16);
  }
}

// f rounded to T, stored.
template <typename T>
inline void store(T* p, int64_t i, float f) {
  if constexpr (std::is_same_v<T, float>) {
    p[i] = f;
  } else {
    reinterpret_cast<uint16_t*>(p)[i] = bfloat16_bits(f);
  }
}

// exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial); below -87 (-inf too) it returns 0 instead of a
// value under 1.65e-38 (a masked logit's probability is 0, as torch's).
inline float exp_nonpositive(float x) {
  const bool underflows = x < -87.0f;
  x = x > -87.0f ? x : -87.0f;
  constexpr float kRound = 12582912.0f;   // 1.5 * 2^23: adding it rounds to an integer (|x log2 e| < 2^22)
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = std::fma(n, -0.693145751953125f, x);
  r = std::fma(n, -1.428606765330187045e-06f, r);
  float p = 1.0f / 720.0f;
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t e = static_cast<int32_t>(n);
  const float value = p * bits_to_float(static_cast<uint32_t>(e + 127) << 23);
  return underflows ? 0.0f : value;
}

}  // namespace element
}  // namespace moezero
