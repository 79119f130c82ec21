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
// The scores (four keys a pass) and the weighted sum of V (three queries' sums of 16 values in
// registers) are AVX2 intrinsics, the softmax is written for the compiler to vectorise (built with
// -O3 -mavx2 -mfma). While a task's keys are scored, the next task's K and V (and an int8 cache's
// scales) are prefetched: without that the op read its cold cache at about a quarter of the
// bandwidth. The V sum was left to the compiler until it was found to vectorise int8 values four
// at a time, through the stack, which made an int8 cache slower to read than a bf16 one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <array>
#include <span>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using aiserve_ops::load8, aiserve_ops::put, aiserve_ops::sum8, aiserve_ops::widen;

constexpr int64_t kBlock = 16;  // values of D summed in registers at once (two AVX2 vectors)

struct Shape {
  int64_t slots, heads, queries, dim;
  int64_t k_slot, k_head, k_pos, v_slot, v_head, v_pos;  // strides of k and v (elements)
  int64_t s_slot, s_head;                                // strides of the int8 scales (position stride 1)
  bool balanced;  // the tasks split among the threads by their keys (balanced_cuts), else by count
  bool prefetch;  // the next task's K and V fetched while a task is scored (Rows), else left to the hardware
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

// The sums of the lanes of a, b, c and e, in that order.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 e) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// A (slot, head)'s K or V rows, to be fetched into the core's cache before they are read. Each
// layer's K/V is read once a step from memory (every layer's cache together is far larger than
// the CPU's), in runs of a few KiB per task: too short for the hardware prefetcher to get ahead
// of, so without this the attention read its keys at a quarter of the machine's bandwidth.
struct Rows {
  const char* base = nullptr;
  int64_t pos_bytes = 0, row_bytes = 0, count = 0;

  void prefetch(int64_t from, int64_t to) const {
    for (int64_t j = from; j < std::min(to, count); ++j)
      for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(base + j * pos_bytes + o, _MM_HINT_T1);
  }
};

// The most bytes of each of a task's K and V fetched ahead: the start of a long context, whose
// rest the hardware prefetcher follows (fetching all of it at once crowded the core's cache).
constexpr int64_t kAheadBytes = 64 * 1024;

// scores[r * length + j] = q_r . k_j (times the key's scale for an int8 cache) for R queries
// (qf: R rows of d floats) and keys [0, length). Four keys a pass: each eight values of a query
// loaded serve four keys, and the four sums are reduced together; the last d % 8 values are
// added one by one. While the keys stream by, ``ahead``'s rows of the same numbers are fetched.
template <int R, int D, typename KV>
void score(const float* qf, const KV* kb, int64_t k_pos, const float* ks, int64_t length, int64_t dim,
           float* scores, std::span<const Rows> ahead) {
  const int64_t d = D > 0 ? D : dim, vec = d - d % 8;
  auto tail = [&](int r, const KV* kj) {
    float t = 0.f;
    for (int64_t c = vec; c < d; ++c) t += qf[r * d + c] * widen(kj[c]);
    return t;
  };
  int64_t j = 0;
  for (; j + 4 <= length; j += 4) {
    for (const Rows& rows : ahead) rows.prefetch(j, j + 4);
    const KV* k0 = kb + j * k_pos;
    __m256 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < vec; c += 8) {
      __m256 key[4];
      for (int t = 0; t < 4; ++t) key[t] = load8(k0 + t * k_pos + c);
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_loadu_ps(qf + r * d + c);
        for (int t = 0; t < 4; ++t) acc[r][t] = _mm256_fmadd_ps(x, key[t], acc[r][t]);
      }
    }
    const __m128 scale = ks ? _mm_loadu_ps(ks + j) : _mm_set1_ps(1.f);
    for (int r = 0; r < R; ++r) {
      __m128 sums = sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      if (vec < d)
        sums = _mm_add_ps(sums, _mm_setr_ps(tail(r, k0), tail(r, k0 + k_pos), tail(r, k0 + 2 * k_pos),
                                            tail(r, k0 + 3 * k_pos)));
      _mm_storeu_ps(scores + r * length + j, _mm_mul_ps(sums, scale));
    }
  }
  for (; j < length; ++j) {
    for (const Rows& rows : ahead) rows.prefetch(j, j + 1);
    const KV* kj = kb + j * k_pos;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < vec; c += 8) {
      const __m256 key = load8(kj + c);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * d + c), key, acc[r]);
    }
    const float scale = ks ? ks[j] : 1.f;
    for (int r = 0; r < R; ++r) scores[r * length + j] = (sum8(acc[r]) + tail(r, kj)) * scale;
  }
}

// D > 0: the head size known at compile time (the loops unroll); 0: read from the shape.
template <typename Q, typename KV, int D>
void run(const Q* q, const KV* k, const KV* v, const float* k_scale, const float* v_scale, const int32_t* lens,
         Q* out, const Shape& s, float scale) {
  const int64_t d = D > 0 ? D : s.dim, nq = s.queries;
  const std::vector<int64_t> cuts = balanced_cuts(lens, s, at::in_parallel_region() ? 1 : at::get_num_threads());
  // One run per thread: at::parallel_for over the runs, grain 1.
  at::parallel_for(0, static_cast<int64_t>(cuts.size()) - 1, 1, [&](int64_t first, int64_t last) {
    std::vector<float> qf(nq * d), acc(nq * d), scores;
    // A task's K and V rows to fetch ahead (at most kAheadBytes of each)
    const int64_t row = d * static_cast<int64_t>(sizeof(KV));
    const int64_t k_pos = s.k_pos * static_cast<int64_t>(sizeof(KV)), v_pos = s.v_pos * static_cast<int64_t>(sizeof(KV));
    // and, for an int8 cache, its K and V scales (float32, one per key: whole lines of them)
    auto blocks = [&](int64_t task) -> std::array<Rows, 4> {
      const int64_t tb = task / s.heads, th = task % s.heads;
      const int32_t* tl = lens + tb * nq;
      const int64_t keys = *std::max_element(tl, tl + nq), count = std::min<int64_t>(keys, kAheadBytes / row);
      std::array<Rows, 4> out{
          Rows{reinterpret_cast<const char*>(k + tb * s.k_slot + th * s.k_head), k_pos, row, count},
          Rows{reinterpret_cast<const char*>(v + tb * s.v_slot + th * s.v_head), v_pos, row, count}, Rows{}, Rows{}};
      if (k_scale) {
        const int64_t offset = tb * s.s_slot + th * s.s_head, lines = (keys * 4 + 63) / 64;
        out[2] = Rows{reinterpret_cast<const char*>(k_scale + offset), 64, 64, lines};
        out[3] = Rows{reinterpret_cast<const char*>(v_scale + offset), 64, 64, lines};
      }
      return out;
    };
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
      // Fetched while this task's keys are scored (by its first queries' pass): the next task's K
      // and V (the run's first task fetches its own first). Its V is read after the softmax, by
      // when it has come.
      if (s.prefetch && bh == cuts[first])
        for (const Rows& own : blocks(bh)) own.prefetch(0, own.count);
      const std::array<Rows, 4> next = s.prefetch && bh + 1 < cuts[last] ? blocks(bh + 1) : std::array<Rows, 4>{};
      int64_t q0 = 0;  // three queries at a time (the default model's group), then one
      for (; q0 + 3 <= nq; q0 += 3)
        score<3, D>(qf.data() + q0 * d, kb, s.k_pos, ksb, length, d, scores.data() + q0 * length,
                    q0 == 0 ? std::span<const Rows>(next) : std::span<const Rows>());
      for (; q0 < nq; ++q0)
        score<1, D>(qf.data() + q0 * d, kb, s.k_pos, ksb, length, d, scores.data() + q0 * length,
                    q0 == 0 ? std::span<const Rows>(next) : std::span<const Rows>());
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
            __m256 x[3][2] = {};
            for (int64_t j = 0; j < length; ++j) {
              const KV* vj = vb + j * s.v_pos + c0;
              const __m256 r[2] = {load8(vj), load8(vj + 8)};
              const __m256 w[3] = {_mm256_set1_ps(p0[j]), _mm256_set1_ps(p1[j]), _mm256_set1_ps(p2[j])};
              for (int r3 = 0; r3 < 3; ++r3)
                for (int half = 0; half < 2; ++half) x[r3][half] = _mm256_fmadd_ps(w[r3], r[half], x[r3][half]);
            }
            for (int r3 = 0; r3 < 3; ++r3)
              for (int half = 0; half < 2; ++half) _mm256_storeu_ps(acc.data() + (i + r3) * d + c0 + 8 * half, x[r3][half]);
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
// either way: each task is computed whole by one thread. prefetch: the next task's K and V are
// fetched while a task is scored; false leaves it to the hardware (kept to measure against;
// the same bits).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            double scale, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale, bool balanced, bool prefetch) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v need 4 dimensions");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attention: CPU tensors");
  TORCH_CHECK(q.is_contiguous(), "decode_attention: q must be contiguous");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1)
                  && k.size(3) == q.size(3) && v.size(3) == q.size(3) && k.size(2) == v.size(2),
              "decode_attention: k, v must be [B, H, T, D] like q");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: k, v need unit stride in D");
  TORCH_CHECK(q.size(2) >= 1, "decode_attention: q needs at least 1 query per slot and head, got 0");
  TORCH_CHECK(q.size(3) >= 1, "decode_attention: q needs at least 1 value per head, got 0");
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
          v.stride(0), v.stride(1), v.stride(2), 0, 0, balanced, prefetch};
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
        "Tensor? v_scale=None, bool balanced=True, bool prefetch=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiserve, CPU, m) { m.impl("decode_attention", &aiserve_ops::decode_attention); }
