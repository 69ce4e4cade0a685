// A quantized KV cache's codes (worker/kv_quant.py is the reference): one byte a value, int8 or fp8 (e4m3fn,
// e5m2), and one fp32 scale per (K/V, kv head, block); a value is code * scale.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

enum KVQuant : int32_t { kNoQuant = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3 };

// How load_codes reads a format: fp8 codes widen to fp16 bits (sign, then the 7 other bits shifted into place),
// which makes e5m2 exact and e4m3 2^-8 of its value: mult (256) is folded into the block's scale.
struct CodeReader {
  bool fp8;
  int shift;
  float mult;
};

inline CodeReader code_reader(int32_t quant) {
  if (quant == kFp8E4M3) return {true, 7, 256.0f};
  if (quant == kFp8E5M2) return {true, 8, 1.0f};
  return {false, 0, 1.0f};
}

namespace {

// kLanes fp16 bit patterns (in 32-bit lanes) as fp32.
inline vfloat half_bits_to_float(vint h) {
  typedef uint16_t vhalf __attribute__((vector_size(kLanes * 2)));
  const vhalf x = __builtin_convertvector(h, vhalf);
  c10::Half halves[kLanes];
  std::memcpy(halves, &x, sizeof(x));
  return load(halves);
}

// kLanes codes as fp32, not yet scaled (e4m3: 2^-8 of the value, see CodeReader).
inline vfloat load_codes(const uint8_t* p, CodeReader r) {
  if (!r.fp8) {
    typedef int8_t vcodes __attribute__((vector_size(kLanes)));
    vcodes c;
    std::memcpy(&c, p, sizeof(c));
    return __builtin_convertvector(__builtin_convertvector(c, vint), vfloat);
  }
  typedef uint8_t vcodes __attribute__((vector_size(kLanes)));
  vcodes c;
  std::memcpy(&c, p, sizeof(c));
  const vint x = __builtin_convertvector(c, vint);
  return half_bits_to_float(((x & 0x80) << 8) | ((x & 0x7f) << r.shift));
}

// n codes as fp32 times scale (the block's scale times r.mult), a vector at a time, then one at a time.
inline void codes_to_float(const uint8_t* src, float* dst, int64_t n, CodeReader r, float scale) {
  const vfloat s = splat(scale);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(dst + i, load_codes(src + i, r) * s);
  for (; i < n; ++i) {
    uint8_t lanes[kLanes] = {};
    lanes[0] = src[i];
    dst[i] = load_codes(lanes, r)[0] * scale;
  }
}

// n codes as bf16 bits, unscaled (exact: every int8 and fp8 value, e4m3's 2^-8 included, is a bf16 value), for the
// bf16 dot products; n a multiple of kLanes.
inline void codes_to_bf16(const uint8_t* src, uint16_t* dst, int64_t n, CodeReader r) {
  typedef uint16_t vbits __attribute__((vector_size(kLanes * 2)));
  for (int64_t i = 0; i < n; i += kLanes) {
    const vbits b = __builtin_convertvector(reinterpret_cast<vint>(load_codes(src + i, r)) >> 16, vbits);
    std::memcpy(dst + i, &b, sizeof(b));
  }
}

}  // namespace

// Writes n new rows of one (K or V, kv head) into a block at offsets [start, start + n): x is n x head_size fp32,
// block the block's block_size x head_size codes, scale its scale (read when start > 0, then grown if the rows
// need more: the codes [0, start) are requantized to it).
void quantize_into_block(const float* x, int64_t n, int64_t head_size, int64_t start, uint8_t* block, float* scale,
                         int32_t quant);
