// The ops of this library that other ops here call directly (each is also a torch.ops.aiserve op),
// the loads and sums its kernels share, and the exponential the attention's softmax vectorises.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace aiserve_ops {

// decode_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            double scale, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale, bool balanced = true, bool prefetch = true);
// gemv.cpp
constexpr int64_t kGemvMaxRows = 4;
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);
// fused_ops.cpp
at::Tensor rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);
void rotate_(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin);

// Stored values as float32 and back, for the kernels that read bf16, float32 or int8 and sum
// in float32: one value widened (bf16 exactly, a shift), eight values loaded into an AVX2
// vector, a float rounded into the stored type, and the sum of a vector's eight lanes.
inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void put(float* dst, float x) { *dst = x; }
inline void put(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }
inline float sum8(__m256 a) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

// exp(x) without a library call (std::exp is one per value): x = n ln2 + r, n the nearest
// integer, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial, 2^n put in the exponent bits.
// Within 2 ulp of std::exp for x in [-87, 88]; below, exp(-87) (a softmax weight beside the
// row maximum's exp(0) = 1 that no float sum can see), above, exp(88). exp_approx takes one
// float, exp8 eight (AVX2), with the same constants and steps.
namespace exp_constants {
constexpr float kLow = -87.f, kHigh = 88.f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln2 in two parts, for r exactly
constexpr float kPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};  // highest power first
}  // namespace exp_constants

inline float exp_approx(float x) {
  using namespace exp_constants;
  x = x < kLow ? kLow : (x > kHigh ? kHigh : x);
  const float n = (x * kLog2e + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kPoly[0];
  for (int k = 1; k < 6; ++k) p = p * r + kPoly[k];
  const float e = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

inline __m256 exp8(__m256 x) {
  using namespace exp_constants;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int k = 1; k < 6; ++k) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kPoly[k]));
  const __m256 e = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

}  // namespace aiserve_ops
