// Decode attention over the slot KV cache (services/inference/native_ops.py builds and loads it).
//
// One engine step's decode rows: slot b's queries q[b, h, i] (its new token and drafts, times the
// query heads that share KV head h) each read the first lens[b, i] keys of that slot's K/V for
// head h. Unlike one masked scaled_dot_product_attention call over the whole batch, each slot
// reads only its own keys, and there is no mask tensor; torch's CPU flash kernel spent most of
// its time on per-(slot, head) set-up for these tiny problems (3 queries of 64 values).
//
// Arithmetic is float32 whatever the storage: bf16 values are widened exactly (a shift), an int8
// cache is scaled per token (kv_cache.py's symmetric int8 with one scale per token per head).
// The loops are written for the compiler to vectorise (built with -O3 -mavx2 -mfma).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void put(float* dst, float x) { *dst = x; }
inline void put(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }

constexpr int64_t kBlock = 16;  // values of D summed in registers at once (two AVX2 vectors)

struct Shape {
  int64_t slots, heads, queries, dim;
  int64_t k_slot, k_head, k_pos, v_slot, v_head, v_pos;  // strides of k and v (elements)
  int64_t s_slot, s_head;                                // strides of the int8 scales (position stride 1)
  bool balanced;  // the tasks split among the threads by their keys (balanced_cuts), else by count
};

// A (slot, head) task's set-up (widening its queries, the softmax passes), in keys' worth of work.
constexpr int64_t kSetupKeys = 8;

// The (slot, head) tasks cut into at most `parts` runs of about equal work; cuts[c]..cuts[c + 1]
// is run c. A task's work is its slot's longest key count (each of its queries is scored against
// that many keys) plus kSetupKeys. at::parallel_for alone cuts the tasks into runs of equal
// count, so where slots hold contexts of unequal lengths one thread gets the long ones and the
// other waits for it at the end of the op.
std::vector<int64_t> balanced_cuts(const int32_t* lens, const Shape& s, int64_t parts) {
  const int64_t n = s.slots * s.heads;
  parts = std::max<int64_t>(1, std::min(parts, n));
  if (!s.balanced) {  // runs of equal count, as at::parallel_for cuts a range by itself
    std::vector<int64_t> cuts;
    const int64_t step = (n + parts - 1) / parts;
    for (int64_t c = 0; c < n; c += step) cuts.push_back(c);
    cuts.push_back(n);
    return cuts;
  }
  std::vector<int64_t> cost(s.slots);
  int64_t total = 0;
  for (int64_t b = 0; b < s.slots; ++b) {
    cost[b] = *std::max_element(lens + b * s.queries, lens + (b + 1) * s.queries) + kSetupKeys;
    total += cost[b] * s.heads;
  }
  std::vector<int64_t> cuts{0};
  int64_t done = 0;
  for (int64_t bh = 0; bh + 1 < n && static_cast<int64_t>(cuts.size()) < parts; ++bh) {
    done += cost[bh / s.heads];
    if (done * parts >= total * static_cast<int64_t>(cuts.size())) cuts.push_back(bh + 1);  // a share is full
  }
  cuts.push_back(n);
  return cuts;
}

// D > 0: the head size known at compile time (the loops unroll); 0: read from the shape.
template <typename Q, typename KV, int D>
void run(const Q* q, const KV* k, const KV* v, const float* k_scale, const float* v_scale, const int32_t* lens,
         Q* out, const Shape& s, float scale) {
  const int64_t d = D > 0 ? D : s.dim, nq = s.queries;
  const std::vector<int64_t> cuts = balanced_cuts(lens, s, at::in_parallel_region() ? 1 : at::get_num_threads());
  // One run per thread: at::parallel_for over the runs, grain 1.
  at::parallel_for(0, static_cast<int64_t>(cuts.size()) - 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> qf(nq * d), acc(nq * d), row(d), scores;
    for (int64_t bh = cuts[first]; bh < cuts[last]; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const KV* kb = k + b * s.k_slot + h * s.k_head;
      const KV* vb = v + b * s.v_slot + h * s.v_head;
      const float* ksb = k_scale ? k_scale + b * s.s_slot + h * s.s_head : nullptr;
      const float* vsb = v_scale ? v_scale + b * s.s_slot + h * s.s_head : nullptr;
      const int32_t* lb = lens + b * nq;
      const int64_t length = *std::max_element(lb, lb + nq);
      const Q* qb = q + bh * nq * d;
      for (int64_t i = 0; i < nq * d; ++i) qf[i] = widen(qb[i]) * scale;
      scores.assign(nq * length, 0.f);
      for (int64_t j = 0; j < length; ++j) {  // scores: every query against key j
        const KV* kj = kb + j * s.k_pos;
        for (int64_t c = 0; c < d; ++c) row[c] = widen(kj[c]);
        const float ks = ksb ? ksb[j] : 1.f;
        int64_t i = 0;
        for (; i + 3 <= nq; i += 3) {  // three queries a pass over the key (the default model's group)
          const float *q0 = qf.data() + i * d, *q1 = q0 + d, *q2 = q1 + d;
          float a0 = 0.f, a1 = 0.f, a2 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2)
          for (int64_t c = 0; c < d; ++c) {
            const float r = row[c];
            a0 += q0[c] * r;
            a1 += q1[c] * r;
            a2 += q2[c] * r;
          }
          scores[i * length + j] = a0 * ks;
          scores[(i + 1) * length + j] = a1 * ks;
          scores[(i + 2) * length + j] = a2 * ks;
        }
        for (; i < nq; ++i) {
          const float* qi = qf.data() + i * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < d; ++c) dot += qi[c] * row[c];
          scores[i * length + j] = dot * ks;
        }
      }
      for (int64_t i = 0; i < nq; ++i) {  // softmax over each query's own keys; the rest weigh 0
        float* si = scores.data() + i * length;
        const int64_t n = lb[i];
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) top = std::max(top, si[j]);
        __m256 sum8 = _mm256_setzero_ps();
        const __m256 top8 = _mm256_set1_ps(top);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
          const __m256 e = aiserve_ops::exp8(_mm256_sub_ps(_mm256_loadu_ps(si + j), top8));
          _mm256_storeu_ps(si + j, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sum8);
        float sum = 0.f;
        for (const float lane : lanes) sum += lane;
        for (; j < n; ++j) {
          si[j] = aiserve_ops::exp_approx(si[j] - top);
          sum += si[j];
        }
        const float inv = n > 0 ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < n; ++j) si[j] *= inv;
        for (int64_t j = n; j < length; ++j) si[j] = 0.f;
      }
      if (vsb)  // an int8 cache's per-token V scale goes into the weights
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t j = 0; j < length; ++j) scores[i * length + j] *= vsb[j];
      // out[i] = sum_j p[i, j] v_j, a block of kBlock values of D at a time for three queries, so
      // their sums stay in registers while the keys stream by
      int64_t i = 0;
      if (d % kBlock == 0)
        for (; i + 3 <= nq; i += 3) {
          const float *p0 = scores.data() + i * length, *p1 = p0 + length, *p2 = p1 + length;
          for (int64_t c0 = 0; c0 < d; c0 += kBlock) {
            float x0[kBlock] = {}, x1[kBlock] = {}, x2[kBlock] = {};
            for (int64_t j = 0; j < length; ++j) {
              const KV* vj = vb + j * s.v_pos + c0;
              const float w0 = p0[j], w1 = p1[j], w2 = p2[j];
#pragma omp simd
              for (int64_t c = 0; c < kBlock; ++c) {
                const float r = widen(vj[c]);
                x0[c] += w0 * r;
                x1[c] += w1 * r;
                x2[c] += w2 * r;
              }
            }
            std::memcpy(acc.data() + i * d + c0, x0, sizeof x0);
            std::memcpy(acc.data() + (i + 1) * d + c0, x1, sizeof x1);
            std::memcpy(acc.data() + (i + 2) * d + c0, x2, sizeof x2);
          }
        }
      for (; i < nq; ++i) {
        float* ai = acc.data() + i * d;
        std::fill(ai, ai + d, 0.f);
        for (int64_t j = 0; j < length; ++j) {
          const KV* vj = vb + j * s.v_pos;
          const float p = scores[i * length + j];
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) ai[c] += p * widen(vj[c]);
        }
      }
      Q* ob = out + bh * nq * d;
      for (int64_t i = 0; i < nq * d; ++i) put(ob + i, acc[i]);
    }
  });
}

template <typename Q, typename KV>
void by_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* k_scale,
            const float* v_scale, const at::Tensor& lens, at::Tensor& out, const Shape& s, float scale) {
  const auto args = std::make_tuple(q.data_ptr<Q>(), k.data_ptr<KV>(), v.data_ptr<KV>(), k_scale, v_scale,
                                    lens.data_ptr<int32_t>(), out.data_ptr<Q>());
  auto call = [&](auto kernel) {
    std::apply([&](auto... a) { kernel(a..., s, scale); }, args);
  };
  if (s.dim == 64)
    call(run<Q, KV, 64>);
  else if (s.dim == 128)
    call(run<Q, KV, 128>);
  else
    call(run<Q, KV, 0>);
}

}  // namespace

namespace aiserve_ops {

// q: [B, H, Q, D] contiguous, bfloat16 or float32; k, v: [B, H, >= max(lens), D] with unit stride
// in D, in q's dtype or int8 (then k_scale, v_scale: [B, H, >= max(lens)] float32, unit stride
// in the position); lens: [B, Q] int32, each >= 1. Returns [B, H, Q, D] in q's dtype.
// balanced: the (slot, head) tasks are split among the threads by the keys they read; false
// splits them by count (at::parallel_for's own cut, kept to measure against). The same bits
// either way: each task is computed whole by one thread.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            double scale, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale, bool balanced) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v need 4 dimensions");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1)
                  && k.size(3) == q.size(3) && v.size(3) == q.size(3) && k.size(2) == v.size(2),
              "decode_attention: k, v must be [B, H, T, D] like q");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k, v need unit stride in D");
  TORCH_CHECK(q.size(2) >= 1, "decode_attention: q needs at least 1 query per slot and head, got 0");
  TORCH_CHECK(lens.scalar_type() == at::kInt && lens.is_contiguous() && lens.dim() == 2 && lens.size(0) == q.size(0)
                  && lens.size(1) == q.size(2),
              "decode_attention: lens must be [B, Q] int32");
  const int32_t* lp = lens.data_ptr<int32_t>();
  TORCH_CHECK(std::all_of(lp, lp + lens.numel(), [&](int32_t n) { return n >= 1 && n <= k.size(2); }),
              "decode_attention: lens must be 1..", k.size(2));
  const bool quantized = k.scalar_type() == at::kChar;
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "decode_attention: k and v need one dtype");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "decode_attention: int8 k, v come with k_scale and v_scale, others without");
  TORCH_CHECK(quantized || k.scalar_type() == q.scalar_type(), "decode_attention: k, v in q's dtype or int8");
  Shape s{q.size(0), q.size(1), q.size(2), q.size(3), k.stride(0), k.stride(1), k.stride(2),
          v.stride(0), v.stride(1), v.stride(2), 0, 0, balanced};
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (quantized) {
    const at::Tensor& a = *k_scale;
    const at::Tensor& b = *v_scale;
    TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.dim() == 3 && b.dim() == 3
                    && a.strides() == b.strides() && a.stride(2) == 1 && a.size(2) >= k.size(2)
                    && b.size(2) >= k.size(2) && a.size(0) == q.size(0) && a.size(1) == q.size(1),
                "decode_attention: k_scale, v_scale must be [B, H, T] float32 with one layout");
    s.s_slot = a.stride(0);
    s.s_head = a.stride(1);
    ks = a.data_ptr<float>();
    vs = b.data_ptr<float>();
  }
  at::Tensor out = at::empty_like(q);
  const float f = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) {
    if (quantized)
      by_dim<c10::BFloat16, int8_t>(q, k, v, ks, vs, lens, out, s, f);
    else
      by_dim<c10::BFloat16, c10::BFloat16>(q, k, v, ks, vs, lens, out, s, f);
  } else if (q.scalar_type() == at::kFloat) {
    if (quantized)
      by_dim<float, int8_t>(q, k, v, ks, vs, lens, out, s, f);
    else
      by_dim<float, float>(q, k, v, ks, vs, lens, out, s, f);
  } else {
    TORCH_CHECK(false, "decode_attention: q must be bfloat16 or float32, got ", q.scalar_type());
  }
  return out;
}

}  // namespace aiserve_ops

TORCH_LIBRARY(aiserve, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lens, float scale, Tensor? k_scale=None, "
        "Tensor? v_scale=None, bool balanced=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiserve, CPU, m) { m.impl("decode_attention", &aiserve_ops::decode_attention); }
