// Every decoder layer of a decode-only step in one call (services/inference/llama.py,
// LlamaModel._decode_layers): the same ops in the same order as the Python loop over layers,
// called from C++. At 16 decoding sequences the loop's Python (argument parsing, the small
// views, a torch.ops call per fused op, ~20 dispatches a layer) was ~13% of the step.
//
// Bit for bit the Python loop's result: the same ATen ops and our own ops (ops.h), the same
// oneDNN product (mkldnn::_linear_pointwise on the packed weight, its rows padded to the same
// bucket), and the K/V rows copied into the cache where the loop's indexed assignment puts them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace {

// How a layer's product runs (llama_weights.Linear): F.linear on the weight; oneDNN on the packed
// weight; F.linear on the float32 copy, the input widened and the result rounded back; oneDNN on
// the packed float32 copy, the same way; our few-row product on the weight (gemv.cpp), which a
// narrow step's products run on (fewer rows than llama.py's WIDE_MIN_ROWS, which it takes).
enum Mode : int64_t { kPlain = 0, kPacked = 1, kWide = 2, kWidePacked = 3, kGemv = 4 };

at::Tensor packed(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, w, b, std::string("none"), c10::List<std::optional<c10::Scalar>>(),
                                 std::optional<std::string>(std::string())};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// aiserve/common/onednn.py, packed_linear: a packed product runs on ``padded`` rows (zeros below x).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b, int64_t mode,
                  int64_t padded) {
  if (mode == kGemv) return aiserve_ops::gemv(x.contiguous(), w, b);
  if (mode == kWide) return at::linear(x.to(w.scalar_type()), w, b).to(x.scalar_type());
  if (mode == kPlain) return at::linear(x, w, b);
  if (mode == kWidePacked) return linear(x.to(w.scalar_type()), w, b, kPacked, padded).to(x.scalar_type());
  const int64_t rows = x.size(0);
  if (padded == rows) return packed(x.contiguous(), w, b);
  return packed(at::cat({x, x.new_zeros({padded - rows, x.size(1)})}), w, b).narrow(0, 0, rows);
}

// Each of x's rows (x [N, KVH, D], unit stride in D) with its flat cache row from rows [N*KVH]:
// write(row, its D values), after checking the row is inside ``cache`` ([..., D]).
template <typename T, typename Write>
void each_row(const at::Tensor& cache, const at::Tensor& x, const int64_t* rows, Write write) {
  const int64_t n = x.size(0), heads = x.size(1), limit = cache.numel() / x.size(2);
  const T* src = x.data_ptr<T>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = rows[t * heads + h];
      TORCH_CHECK(row >= 0 && row < limit, "decode_layers: cache row ", row, " outside 0..", limit - 1);
      write(row, src + t * x.stride(0) + h * x.stride(1));
    }
}

// One layer's K or V rows of the step into its cache (cache.view(-1, D)[rows] = x.reshape(-1, D)),
// or, for an int8 cache with its scales [S*KVH*T], quantized as kv_cache.py's quantize_int8 does:
// per row, scale = max|x| / 127 (1 for a row of zeros), values x / scale rounded to nearest even
// and clamped to +-127, all in float32 (torch's bits: its division is IEEE's too).
template <typename T>
void store(const at::Tensor& cache, const std::optional<at::Tensor>& scales, const at::Tensor& x, const int64_t* rows) {
  const int64_t d = x.size(2);
  if (!scales) {
    auto* dst = static_cast<T*>(cache.data_ptr());
    each_row<T>(cache, x, rows, [&](int64_t row, const T* xr) { std::memcpy(dst + row * d, xr, d * sizeof(T)); });
    return;
  }
  auto* dst = cache.data_ptr<int8_t>();
  auto* scale = scales->data_ptr<float>();
  each_row<T>(cache, x, rows, [&](int64_t row, const T* xr) {
    float amax = 0.f;
    for (int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(aiserve_ops::widen(xr[c])));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    for (int64_t c = 0; c < d; ++c)
      dst[row * d + c] = static_cast<int8_t>(std::clamp(std::nearbyint(aiserve_ops::widen(xr[c]) / s), -127.f, 127.f));
    scale[row] = s;
  });
}

void store_any(const at::Tensor& cache, const std::optional<at::Tensor>& scales, const at::Tensor& x,
               const int64_t* rows) {
  if (x.scalar_type() == at::kBFloat16) return store<c10::BFloat16>(cache, scales, x, rows);
  store<float>(cache, scales, x, rows);
}

// h [N, hidden]: the embedded tokens of N decode rows, one per slot of [lo, hi) in slot order;
// per layer, norms (attention's, then the MLP's) and weights, biases, modes of the products
// (qkv, o, gate_up, down); cos, signed_sin [N, D]; k_cache, v_cache [layers, S, KVH, T, D];
// cache_rows [N*KVH] (each new K/V's row in a layer's [S*KVH*T, D] view); lens [N, G] int32 (keys
// each query reads); an int8 cache comes with its scales k_scale, v_scale [layers, S, KVH, T]
// float32 (kv_cache.py), which the step's K/V rows are quantized into. Returns h after the last
// layer (its residual added); writes the K/V.
at::Tensor decode_layers(at::Tensor h, at::TensorList norms, at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef modes,
                         const at::Tensor& cos, const at::Tensor& signed_sin, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& cache_rows, int64_t lo, int64_t hi,
                         int64_t length, const at::Tensor& lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                         int64_t padded_rows, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& v_scale) {
  const bool quantized = k_cache.scalar_type() == at::kChar;
  const at::ScalarType stored = quantized ? at::kChar : h.scalar_type();
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes()
                  && v_cache.is_contiguous() && k_cache.scalar_type() == stored && v_cache.scalar_type() == stored,
              "decode_layers: k_cache, v_cache must be contiguous [layers, S, KVH, T, D] in h's dtype or int8");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "decode_layers: an int8 cache comes with k_scale and v_scale, others without");
  if (quantized)
    for (const at::Tensor& s : {*k_scale, *v_scale})
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous()
                      && s.sizes() == k_cache.sizes().slice(0, 4),
                  "decode_layers: k_scale, v_scale must be contiguous [layers, S, KVH, T] float32");
  const int64_t layers = k_cache.size(0), n = h.size(0), kvh = num_kv_heads, d = k_cache.size(4);
  TORCH_CHECK(num_heads > 0 && kvh > 0 && num_heads % kvh == 0 && k_cache.size(2) == kvh,
              "decode_layers: num_heads must be a multiple of num_kv_heads, the cache's KV heads");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(weights.size()) == 4 * layers
                  && static_cast<int64_t>(biases.size()) == 4 * layers
                  && static_cast<int64_t>(modes.size()) == 4 * layers,
              "decode_layers: 2 norms and 4 products (weights, biases, modes) per layer of the cache, ", layers);
  TORCH_CHECK(lo >= 0 && hi - lo == n && hi <= k_cache.size(1) && length >= 1 && length <= k_cache.size(3),
              "decode_layers: one row per slot of [lo, hi) within the cache, length 1..", k_cache.size(3));
  TORCH_CHECK(cache_rows.scalar_type() == at::kLong && cache_rows.is_contiguous() && cache_rows.numel() == n * kvh,
              "decode_layers: cache_rows must be [N*KVH] int64");
  TORCH_CHECK(padded_rows >= n, "decode_layers: padded_rows must be at least the rows, ", n);
  const double scale = std::pow(static_cast<double>(d), -0.5);
  const int64_t* rows = cache_rows.data_ptr<int64_t>();
  std::optional<at::Tensor> delta;  // the last sublayer's output, not yet added to h
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t p = 4 * l;
    at::Tensor x = aiserve_ops::rms_norm(h, delta, norms[2 * l], eps);
    at::Tensor qkv = linear(x, weights[p], biases.get(p), modes[p], padded_rows);  // [N, (H + 2*KVH) * D]
    at::Tensor heads = qkv.view({n, num_heads + 2 * kvh, d});
    aiserve_ops::rotate_(heads.narrow(1, 0, num_heads + kvh), cos, signed_sin);  // q and k
    const at::Tensor kc = k_cache.select(0, l), vc = v_cache.select(0, l);
    std::optional<at::Tensor> ks, vs, ks_read, vs_read;  // this layer's scales, and those the attention reads
    if (quantized) {
      ks = k_scale->select(0, l), vs = v_scale->select(0, l);
      ks_read = ks->narrow(0, lo, n).narrow(2, 0, length), vs_read = vs->narrow(0, lo, n).narrow(2, 0, length);
    }
    store_any(kc, ks, heads.narrow(1, num_heads, kvh), rows);
    store_any(vc, vs, heads.narrow(1, num_heads + kvh, kvh), rows);
    at::Tensor q = heads.narrow(1, 0, num_heads).view({n, kvh, num_heads / kvh, d}).contiguous();
    at::Tensor out = aiserve_ops::decode_attention(q, kc.narrow(0, lo, n).narrow(2, 0, length),
                                                   vc.narrow(0, lo, n).narrow(2, 0, length), lens, scale,
                                                   ks_read, vs_read);
    at::Tensor o = linear(out.view({n, num_heads * d}), weights[p + 1], biases.get(p + 1), modes[p + 1], padded_rows);
    x = aiserve_ops::rms_norm(h, o, norms[2 * l + 1], eps);
    at::Tensor gate_up = linear(x, weights[p + 2], biases.get(p + 2), modes[p + 2], padded_rows);
    const int64_t inter = gate_up.size(1) / 2;
    at::Tensor act = at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
    delta = linear(act, weights[p + 3], biases.get(p + 3), modes[p + 3], padded_rows);
  }
  return delta ? at::add(h, *delta) : h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aiserve, m) {
  m.def("decode_layers(Tensor(a!) h, Tensor[] norms, Tensor[] weights, Tensor?[] biases, int[] modes, Tensor cos, "
        "Tensor signed_sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor cache_rows, int lo, int hi, int length, "
        "Tensor lens, int num_heads, int num_kv_heads, float eps, int padded_rows, Tensor(d!)? k_scale=None, "
        "Tensor(e!)? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(aiserve, CPU, m) { m.impl("decode_layers", &decode_layers); }
// oneDNN-packed weights are MkldnnCPU tensors: the call dispatches on that key then
TORCH_LIBRARY_IMPL(aiserve, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
