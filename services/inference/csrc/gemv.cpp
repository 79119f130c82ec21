// A product of a few rows (a decode step of one to four new tokens) with a weight in its own
// [N, K] layout: y = x @ w.T (+ b), x [M, K] with M <= kGemvMaxRows (ops.h).
//
// With so few rows the product reads every weight byte for a handful of multiply-adds, so its
// speed is the speed at which the weight streams from memory. oneDNN's kernel reached ~16 GB/s
// over a step's 120 small decoder products (each 0.7-3.5 MB, each its own parallel region that
// the hardware prefetcher starts cold), against the ~27 GB/s it reached on the one 56 MB lm_head
// and the machine's ~29 GB/s (AMD EPYC VM, 2 cores). Here each thread reads one contiguous run of
// the weight's rows and fetches a fixed distance ahead of what it reads, so the stream runs at
// full speed from its first bytes.
//
// Arithmetic is float32 whatever the storage (a bf16 weight is widened exactly, a shift), summed
// over K in 8-wide lanes in a fixed order that depends neither on M nor on the threads: a row's
// result is the same alone or beside others. AVX2 + FMA, which both CPU kinds we serve on have.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kAheadBytes = 4096;  // how far ahead of its reads a thread fetches its weight rows

using aiserve_ops::load8, aiserve_ops::put, aiserve_ops::sum8, aiserve_ops::widen;

// The bias as it is stored (float32 or bf16, read in place: no converted copy per call), or none.
struct Bias {
  const float* f = nullptr;
  const c10::BFloat16* h = nullptr;
  explicit operator bool() const { return f || h; }
  float operator[](int64_t i) const { return f ? f[i] : widen(h[i]); }
};

// Rows [n0, n1) of the weight against the M rows of xf (float32, [M, K]): NB weight rows at a time,
// each 8 values of K loaded once for the M rows; the K % 8 last values one by one.
template <int M, typename W, typename Y>
void rows(const float* xf, const W* w, Bias b, Y* y, int64_t n0, int64_t n1, int64_t k, int64_t n) {
  constexpr int NB = M <= 2 ? 4 : 2;  // NB * M accumulators of 8 lanes
  const int64_t vec = k - k % 8;
  const char* end = reinterpret_cast<const char*>(w + n1 * k);
  auto finish = [&](int64_t row, int m, float total) {
    for (int64_t c = vec; c < k; ++c) total += xf[m * k + c] * widen(w[row * k + c]);
    put(y + m * n + row, b ? total + b[row] : total);
  };
  int64_t r = n0;
  for (; r + NB <= n1; r += NB) {
    const W* wr = w + r * k;
    __m256 acc[NB][M];
    for (int i = 0; i < NB; ++i)
      for (int m = 0; m < M; ++m) acc[i][m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < vec; c += 8) {
      // The block's NB rows are contiguous: this pass reads NB * 8 values of it, so the run of
      // bytes fetched moves on by as much (a line for bf16 at NB = 4), kAheadBytes ahead.
      const char* ahead = reinterpret_cast<const char*>(wr) + kAheadBytes + c * NB * sizeof(W);
      if (ahead < end) _mm_prefetch(ahead, _MM_HINT_T0);
      if constexpr (sizeof(W) * 8 * NB > 64)
        if (ahead + 64 < end) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      __m256 wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = load8(wr + i * k + c);
      for (int m = 0; m < M; ++m) {
        const __m256 xv = _mm256_loadu_ps(xf + m * k + c);
        for (int i = 0; i < NB; ++i) acc[i][m] = _mm256_fmadd_ps(xv, wv[i], acc[i][m]);
      }
    }
    for (int i = 0; i < NB; ++i)
      for (int m = 0; m < M; ++m) finish(r + i, m, sum8(acc[i][m]));
  }
  for (; r < n1; ++r) {
    const W* wr = w + r * k;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < vec; c += 8) {
      const __m256 wv = load8(wr + c);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * k + c), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) finish(r, m, sum8(acc[m]));
  }
}

template <typename W, typename Y>
void run(const at::Tensor& x, const at::Tensor& w, Bias b, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  std::vector<float> xf(m * k);  // x widened once
  const Y* xp = x.data_ptr<Y>();
  for (int64_t i = 0; i < m * k; ++i) xf[i] = widen(xp[i]);
  const W* wp = w.data_ptr<W>();
  Y* yp = y.data_ptr<Y>();
  // One contiguous run of rows per thread, cut at multiples of 8 rows
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t per = (n + threads - 1) / threads, step = (per + 7) / 8 * 8;
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t n0 = std::min(n, t * step), n1 = std::min(n, (t + 1) * step);
      if (n0 >= n1) continue;
      switch (m) {
        case 1: rows<1>(xf.data(), wp, b, yp, n0, n1, k, n); break;
        case 2: rows<2>(xf.data(), wp, b, yp, n0, n1, k, n); break;
        case 3: rows<3>(xf.data(), wp, b, yp, n0, n1, k, n); break;
        default: rows<4>(xf.data(), wp, b, yp, n0, n1, k, n); break;
      }
    }
  });
}

}  // namespace

namespace aiserve_ops {

// x [M, K] bfloat16 or float32, 0 <= M <= 4, contiguous; w [N, K] contiguous, in x's dtype (or
// bfloat16 under a float32 x); b [N] float32 or bfloat16, or none. Returns [M, N] in x's dtype.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv: x [M, K] and w [N, K] need the same K, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(0) <= kGemvMaxRows, "gemv: x takes at most ", kGemvMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && x.is_contiguous() && w.is_contiguous(),
              "gemv: x and w must be contiguous CPU tensors");
  const bool bf16_x = x.scalar_type() == at::kBFloat16, bf16_w = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16_x || x.scalar_type() == at::kFloat) && (bf16_w || w.scalar_type() == at::kFloat)
                  && (w.scalar_type() == x.scalar_type() || bf16_w),
              "gemv: x bfloat16 or float32, w in x's dtype or bfloat16, got ", x.scalar_type(), " and ",
              w.scalar_type());
  at::Tensor bias;
  Bias bp;
  if (b) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == w.size(0), "gemv: b must be [N], N = ", w.size(0));
    TORCH_CHECK(b->scalar_type() == at::kFloat || b->scalar_type() == at::kBFloat16,
                "gemv: b must be float32 or bfloat16, got ", b->scalar_type());
    bias = b->contiguous();
    if (bias.scalar_type() == at::kFloat)
      bp.f = bias.data_ptr<float>();
    else
      bp.h = bias.data_ptr<c10::BFloat16>();
  }
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0) return y;  // a step whose rows want no logits: the lm_head on none
  if (bf16_x)
    run<c10::BFloat16, c10::BFloat16>(x, w, bp, y);
  else if (bf16_w)
    run<c10::BFloat16, float>(x, w, bp, y);
  else
    run<float, float>(x, w, bp, y);
  return y;
}

}  // namespace aiserve_ops

TORCH_LIBRARY_FRAGMENT(aiserve, m) { m.def("gemv(Tensor x, Tensor w, Tensor? b=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(aiserve, CPU, m) { m.impl("gemv", &aiserve_ops::gemv); }
