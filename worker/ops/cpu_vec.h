// Vector helpers shared by the CPU kernels: GCC/Clang vector extensions as wide as the build's ISA,
// bf16/fp16 <-> fp32 conversion, and exp for non-positive arguments.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace {

// Vectors through the GCC/Clang vector extension: as wide as the ISA the build targets.
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr int kLanes = kVecBytes / 4;
typedef float vfloat __attribute__((vector_size(kVecBytes)));
typedef int32_t vint __attribute__((vector_size(kVecBytes)));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// kLanes fp16 values as fp32 (exact).
inline vfloat load(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfloat w;
  for (int i = 0; i < kLanes; ++i) w[i] = static_cast<float>(p[i]);
#endif
  vfloat v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
// x in every lane: one vbroadcastss (vfloat{} + x costs an add too: 0 + x is not x for x = -0).
template <size_t... I>
inline vfloat splat(float x, std::index_sequence<I...>) { return vfloat{((void)I, x)...}; }
inline vfloat splat(float x) { return splat(x, std::make_index_sequence<kLanes>{}); }
inline vint splat_int(int32_t x) { return vint{} + x; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
// Butterfly across lanes: after the steps W = kLanes/2 .. 1 every lane holds the reduction.
template <int W, size_t... I>
inline vfloat swap_lanes(vfloat v, std::index_sequence<I...>) {
  return __builtin_shufflevector(v, v, (I ^ W)...);
}
template <int W = kLanes / 2>
inline float hmax(vfloat v) {
  v = vmax(v, swap_lanes<W>(v, std::make_index_sequence<kLanes>{}));
  if constexpr (W > 1) return hmax<W / 2>(v);
  return v[0];
}
template <int W = kLanes / 2>
inline float hsum(vfloat v) {
  v += swap_lanes<W>(v, std::make_index_sequence<kLanes>{});
  if constexpr (W > 1) return hsum<W / 2>(v);
  return v[0];
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// bf16 dot products in fp32 (AVX512-BF16's vdpbf16ps): each bf16 x bf16 product is exact in fp32, so
// these equal converting to fp32 first, up to the order of the fp32 additions.
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
// Lane l of the result: acc[l] + a[2l] * b[2l] + a[2l+1] * b[2l+1], over 32 bf16 values each.
inline vfloat dot_bf16(vfloat acc, const void* a, const void* b) {
  return reinterpret_cast<vfloat>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc),
                                                   (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b)));
}
// The same with b's 16 values (32 bytes) in both halves: lanes 0-7 take a's first 16 values, 8-15 its last.
inline vfloat dot_bf16_half(vfloat acc, const void* a, const void* b) {
  const __m512i bb = _mm512_broadcast_i64x4(_mm256_loadu_si256(static_cast<const __m256i*>(b)));
  return reinterpret_cast<vfloat>(
      _mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), (__m512bh)_mm512_loadu_si512(a), (__m512bh)bb));
}
// The same with b one bf16 pair (its 32 bits) broadcast to every lane.
inline vfloat dot_bf16_pair(vfloat acc, const void* a, uint32_t b_pair) {
  return reinterpret_cast<vfloat>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), (__m512bh)_mm512_loadu_si512(a),
                                                   (__m512bh)_mm512_set1_epi32(static_cast<int>(b_pair))));
}
// 32 bf16 values of a and of b (b_too false: zeros, b not read) as pairs (a, b): lane l of lo holds value
// 8 * (l / 4) + l % 4 of each, lane l of hi that value + 4 (the order of vpunpcklwd / vpunpckhwd in 128-bit lanes).
inline void interleave_bf16(const void* a, const void* b, bool b_too, vint& lo, vint& hi) {
  const __m512i x = _mm512_loadu_si512(a), y = _mm512_maskz_loadu_epi16(b_too ? ~__mmask32{0} : 0, b);
  lo = reinterpret_cast<vint>(_mm512_unpacklo_epi16(x, y));
  hi = reinterpret_cast<vint>(_mm512_unpackhi_epi16(x, y));
}
// dot_bf16_pair with a already in a register.
inline vfloat dot_bf16_bits(vfloat acc, vint a, uint32_t b_pair) {
  return reinterpret_cast<vfloat>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc), reinterpret_cast<__m512bh>(a),
                                                   (__m512bh)_mm512_set1_epi32(static_cast<int>(b_pair))));
}
// interleave_bf16's lanes (after a dot product) back in value order: values 0-15 (first) or 16-31.
template <bool kFirst>
inline vfloat deinterleave(vfloat lo, vfloat hi) {
  if constexpr (kFirst) return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  return __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}
// kLanes fp32 values as two bf16 terms, hi = x rounded (to nearest even) and lo = the rest rounded: hi + lo is x to
// about 2^-17 of its magnitude.
inline void store_bf16_split(uint16_t* hi, uint16_t* lo, vfloat x) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  const vfloat rest = x - reinterpret_cast<vfloat>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest)));
}
#else
constexpr bool kBf16Dot = false;
// Declared only: callers use them under `if constexpr (kBf16Dot)`, which discards the calls on other CPUs.
vfloat dot_bf16(vfloat acc, const void* a, const void* b);
vfloat dot_bf16_half(vfloat acc, const void* a, const void* b);
vfloat dot_bf16_pair(vfloat acc, const void* a, uint32_t b_pair);
void interleave_bf16(const void* a, const void* b, bool b_too, vint& lo, vint& hi);
vfloat dot_bf16_bits(vfloat acc, vint a, uint32_t b_pair);
template <bool kFirst>
vfloat deinterleave(vfloat lo, vfloat hi);
void store_bf16_split(uint16_t* hi, uint16_t* lo, vfloat x);
#endif

// kLanes bf16 values as fp32.
inline vfloat load_bf16(const c10::BFloat16* p) {
#if defined(__AVX512F__)  // one widening load (GCC 12 splits the generic conversion below into 256-bit pieces)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<vfloat>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(__AVX2__)  // likewise (the generic one widens 128 bits at a time)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vfloat>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  typedef uint16_t vbits __attribute__((vector_size(kVecBytes / 2)));
  vbits b;
  std::memcpy(&b, p, sizeof(b));
  return reinterpret_cast<vfloat>(__builtin_convertvector(b, vint) << 16);
#endif
}

// n values as fp32; bf16 a vector at a time (its bits are the high half of an fp32).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + kLanes <= n; i += kLanes) store(dst + i, load_bf16(src + i));
  }
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// exp for x <= 0 (Cephes' single-precision polynomial, ~1 ulp), lane-wise; exp(-87) and below ~ 0.
inline vfloat exp_nonpos(vfloat x) {
  x = vmax(x, splat(-87.0f));
  const vint n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vint);  // round to nearest for x <= 0
  const vfloat nf = __builtin_convertvector(n, vfloat);
  const vfloat r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vfloat y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  return y * reinterpret_cast<vfloat>((n + 127) << 23);
}

// c * tanh(x / c), lane-wise (attention soft-capping): tanh(|y|) = (1 - e) / (1 + e), e = exp(-2|y|), sign restored.
inline vfloat soft_cap(vfloat x, float c) {
  const vfloat y = x / c;
  const vfloat e = exp_nonpos(y < 0 ? y * 2.0f : y * -2.0f);
  const vfloat t = (1.0f - e) / (1.0f + e);
  return (y < 0 ? -t : t) * c;
}

// n fp32 values stored as T; bf16 rounded to nearest even a vector at a time (NaN stays NaN).
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    typedef uint16_t vbits __attribute__((vector_size(kVecBytes / 2)));
    for (; i + kLanes <= n; i += kLanes) {
      const vfloat x = load(src + i);
      const vint bits = reinterpret_cast<vint>(x);
      vint rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
      rounded = x != x ? splat_int(0x7FC0) : rounded;
      const vbits b = __builtin_convertvector(rounded, vbits);
      std::memcpy(dst + i, &b, sizeof(b));
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace
