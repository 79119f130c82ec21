// The ops of this library that other ops here call directly (each is also a torch.ops.aiserve op).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace aiserve_ops {

// decode_attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            double scale, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale);
// fused_ops.cpp
at::Tensor rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight, double eps);
void rotate_(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin);

}  // namespace aiserve_ops
