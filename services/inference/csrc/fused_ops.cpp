// Fused element-wise steps of the forward (services/inference/llama.py): the residual add with the
// RMSNorm after it, and the rotary embedding, one pass over each row instead of one torch op (and
// one parallel region) per arithmetic step; and the greedy rows' argmax (services/inference/sampler.py). (A fused SiLU x up was measured too and left out:
// scalar exp made it 4x slower than torch's vectorised SiLU at 64 rows; with AVX2 intrinsics and
// ops.h's exp8 it gave torch's bf16 bits but took 65 against torch's 46 us at [64, 2 x 1536].)
//
// Each op rounds where the torch code it replaces rounds (to the tensor's dtype after each torch
// op), so bf16 results differ from it only where a float32 sum is added up in another order
// (the RMS statistic). Rows are split across threads only when there are enough of them to be
// worth a parallel region.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// No fused multiply-adds: x * cos + roll(x) * sin must round its products as torch does.
#pragma GCC optimize("fp-contract=off")

namespace {

constexpr int64_t kRowsPerTask = 16;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// The value as the tensor's dtype holds it (float32: itself; bf16: rounded to nearest even).
inline float round_to(float x, float*) { return x; }
inline float round_to(float x, c10::BFloat16*) { return static_cast<float>(c10::BFloat16(x)); }
inline void put(float* dst, float x) { *dst = x; }
inline void put(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }

template <typename T>
T* typed(T* p) { return p; }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name, ": a [N, hidden] CPU tensor with unit stride");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name, ": bfloat16 or float32");
}

// y = weight * (x * rsqrt(mean(x^2) + eps)), statistics in float32; where ``delta`` is given, first
// x += delta in place (the residual add). As llama.rms_norm: the normalised row is rounded to
// the dtype, then multiplied by the weight (and rounded again).
template <typename T>
void norm_rows(T* x, const T* delta, const T* weight, T* y, int64_t rows, int64_t cols, int64_t x_stride,
               int64_t d_stride, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      if (delta) {
        const T* dr = delta + r * d_stride;
        for (int64_t c = 0; c < cols; ++c) put(xr + c, widen(xr[c]) + widen(dr[c]));
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = widen(xr[c]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
      T* yr = y + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const float normed = round_to(widen(xr[c]) * inv, typed<T>(nullptr));
        put(yr + c, widen(weight[c]) * normed);
      }
    }
  });
}

}  // namespace

namespace aiserve_ops {

at::Tensor rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1)
                  && weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be [hidden] in x's dtype");
  if (delta) {
    check_rows(*delta, "rms_norm: delta");
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(),
                "rms_norm: delta must be shaped and typed as x");
  }
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), cols = x.size(1), ds = delta ? delta->stride(0) : 0;
  if (x.scalar_type() == at::kBFloat16)
    norm_rows(x.data_ptr<c10::BFloat16>(), delta ? delta->data_ptr<c10::BFloat16>() : nullptr,
              weight.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, cols, x.stride(0), ds,
              static_cast<float>(eps));
  else
    norm_rows(x.data_ptr<float>(), delta ? delta->data_ptr<float>() : nullptr, weight.data_ptr<float>(),
              y.data_ptr<float>(), rows, cols, x.stride(0), ds, static_cast<float>(eps));
  return y;
}

}  // namespace aiserve_ops

namespace {

// x [N, heads, D] (unit stride in D) in place: x * cos + roll(x, D/2) * signed_sin, with cos and
// signed_sin [N, D] in x's dtype; each product and the sum rounded as the torch ops do.
template <typename T>
void rotate_rows(T* x, const T* cos, const T* sin, int64_t n, int64_t heads, int64_t d, int64_t s_tok,
                 int64_t s_head) {
  const int64_t half = d / 2;
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    float row[512];
    for (int64_t t = begin; t < end; ++t) {
      const T* ct = cos + t * d;
      const T* st = sin + t * d;
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + t * s_tok + h * s_head;
        for (int64_t c = 0; c < d; ++c) row[c] = widen(xh[c]);
        for (int64_t c = 0; c < d; ++c) {
          const float rolled = row[c < half ? c + half : c - half];
          const float a = round_to(row[c] * widen(ct[c]), typed<T>(nullptr));
          const float b = round_to(rolled * widen(st[c]), typed<T>(nullptr));
          put(xh + c, a + b);
        }
      }
    }
  });
}

}  // namespace

namespace aiserve_ops {

void rotate_(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "rotate_: x must be [N, heads, D], unit stride in D");
  const int64_t d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= 512, "rotate_: head size must be even and at most 512");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == x.size(0)
                  && cos.size(1) == d && signed_sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type()
                  && signed_sin.scalar_type() == x.scalar_type(),
              "rotate_: cos, signed_sin must be [N, D] in x's dtype");
  if (x.scalar_type() == at::kBFloat16)
    rotate_rows(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), signed_sin.data_ptr<c10::BFloat16>(),
                x.size(0), x.size(1), d, x.stride(0), x.stride(1));
  else if (x.scalar_type() == at::kFloat)
    rotate_rows(x.data_ptr<float>(), cos.data_ptr<float>(), signed_sin.data_ptr<float>(), x.size(0), x.size(1), d,
                x.stride(0), x.stride(1));
  else
    TORCH_CHECK(false, "rotate_: bfloat16 or float32");
}

}  // namespace aiserve_ops

TORCH_LIBRARY_FRAGMENT(aiserve, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rotate_(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
}

TORCH_LIBRARY_IMPL(aiserve, CPU, m) {
  m.impl("rms_norm", &aiserve_ops::rms_norm);
  m.impl("rotate_", &aiserve_ops::rotate_);
}

namespace {

// The first index of each row's largest value, as torch.max(x, -1).indices gives it (a NaN is the
// largest: the first NaN's index). Two passes over a row that stays in cache: its maximum (a
// reduction the compiler vectorises), then the first place that holds it.
template <typename T>
void first_max(const T* x, int64_t* out, int64_t rows, int64_t cols, int64_t stride) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * stride;
      float top = -std::numeric_limits<float>::infinity();
      int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
      for (int64_t c = 0; c < cols; ++c) {
        const float v = widen(xr[c]);
        top = std::max(top, v);
        nan |= static_cast<int>(v != v);
      }
      int64_t at = 0;
      if (nan) {
        while (widen(xr[at]) == widen(xr[at])) ++at;
      } else {
        while (widen(xr[at]) != top) ++at;
      }
      out[r] = at;
    }
  });
}

}  // namespace

namespace aiserve_ops {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be a [rows, cols > 0] CPU tensor with unit stride");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kBFloat16)
    first_max(x.data_ptr<c10::BFloat16>(), out.data_ptr<int64_t>(), x.size(0), x.size(1), x.stride(0));
  else if (x.scalar_type() == at::kFloat)
    first_max(x.data_ptr<float>(), out.data_ptr<int64_t>(), x.size(0), x.size(1), x.stride(0));
  else
    TORCH_CHECK(false, "argmax_rows: bfloat16 or float32");
  return out;
}

}  // namespace aiserve_ops

TORCH_LIBRARY_FRAGMENT(aiserve, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(aiserve, CPU, m) { m.impl("argmax_rows", &aiserve_ops::argmax_rows); }
