// The write side of a quantized KV cache (kv_quant.h): a block's scale chosen from its rows as they are written,
// rounded as torch rounds (worker/kv_quant.py, the reference: int8 to nearest even, fp8 by c10's conversions).

#include "kv_quant.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>

namespace {

float qmax(int32_t quant) { return quant == kInt8 ? 127.0f : quant == kFp8E4M3 ? 448.0f : 57344.0f; }

// The smallest scale that holds absmax: absmax / 127, or for fp8 a power of two (0 for 0).
float block_scale(float absmax, int32_t quant) {
  const float ratio = absmax / qmax(quant);
  if (quant == kInt8 || !(ratio > 0.0f)) return ratio > 0.0f ? ratio : 0.0f;
  int e = 0;
  const float m = std::frexp(ratio, &e);  // ratio = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

uint8_t to_code(float x, float scale, int32_t quant) {
  const float lim = qmax(quant);
  const float y = std::clamp(scale > 0.0f ? x / scale : 0.0f, -lim, lim);
  if (quant == kInt8) return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
  return quant == kFp8E4M3 ? c10::Float8_e4m3fn(y).x : c10::Float8_e5m2(y).x;
}

float from_code(uint8_t c, int32_t quant) {
  if (quant == kInt8) return static_cast<float>(static_cast<int8_t>(c));
  if (quant == kFp8E4M3) return static_cast<float>(c10::Float8_e4m3fn(c, c10::Float8_e4m3fn::from_bits()));
  return static_cast<float>(c10::Float8_e5m2(c, c10::Float8_e5m2::from_bits()));
}

}  // namespace

void quantize_into_block(const float* x, int64_t n, int64_t head_size, int64_t start, uint8_t* block, float* scale,
                         int32_t quant) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n * head_size; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float need = block_scale(absmax, quant);
  const float old = *scale;
  const float s = start > 0 ? std::max(old, need) : need;
  if (start > 0 && s > old) {
    for (int64_t i = 0; i < start * head_size; ++i) block[i] = to_code(from_code(block[i], quant) * old, s, quant);
  }
  *scale = s;
  uint8_t* dst = block + start * head_size;
  for (int64_t i = 0; i < n * head_size; ++i) dst[i] = to_code(x[i], s, quant);
}
