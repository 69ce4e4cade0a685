// The functions the kvengine CPU extension exports (module.cpp binds them to Python).
#pragma once

#include <ATen/ATen.h>

#include <optional>

// Attention over the paged cache, read in place through the block table (paged_attention.cpp); kv_scales: a
// quantized cache's scales (kv_quant.h).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t window,
                           double scale, double softcap, const std::optional<at::Tensor>& kv_scales);
void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache, const at::Tensor& block_table,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       const std::optional<at::Tensor>& kv_scales);

// A decoder layer's elementwise work, one pass each (layer_ops.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);

// Weight-only int8 matmul, x [m, k] by q [n, k] int8 with a float32 scale per group of k / scale.size(1) inputs
// (quant_matmul.cpp).
at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
// Weight-only int4 matmul of fp32 x [m, k] by torch's packed int4 CPU layout [n_pad, k / 2], w = q * scale + min with
// (scale, min) blocked as [n_pad / B, k / 32, B, 2] in float32 or float16 -> [m, n_pad]; order: the layout's row order
// within a block of B rows (quant_matmul.cpp).
at::Tensor int4_group_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                             const at::Tensor& order);
// Quantized weights in a dense dtype, for the GEMM of large batches: torch's packed int4 CPU layout with its
// [k / 32, n_pad, 2] scales and zeros (or int4_group_linear's blocked (scale, min), then in float32) -> the transposed
// weight [k, n_pad]; int8 codes and group scales -> [n, k].
at::Tensor int4_dequantize_t(const at::Tensor& packed, const at::Tensor& scale_zero, const at::Tensor& order);
at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype);
// fp32 x [..., k] times a weight [n, k] kept in bf16 or fp16 (exact values of the checkpoint): half_pack packs it once
// into [ceil(n / P), k, P] panels (P: two vectors of this build's ISA), half_linear multiplies -> [..., n] fp32
// (half_matmul.cpp).
at::Tensor half_pack(const at::Tensor& weight, at::ScalarType dtype);
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias);
