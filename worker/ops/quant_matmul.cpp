// Weight-only quantized matmuls (worker/ops/quant_linear.py).
//
// int8_group_linear, small batches (decode): W[n, k] = q[n, k] * scale[n, k / group], read once as int8 (a GGUF
// Q8_0 tensor: group 32; --quantization rtn: group 128), so a decode step reads half the bytes of bf16. Each
// group's codes are widened to fp32 once and multiplied with every row of x; sums in fp32, one rounding to x's
// dtype at the end.
//
// int4_dequantize_t and int8_dequantize, large batches (prefill): the weight in the activations' dtype, in one
// pass, for the dense GEMM. Torch's packed int4 layout holds, for each block of 64 output rows and each input k,
// 32 bytes: byte j's low nibble is row j, its high nibble row 32 + j; so the transposed weight [k, n] is written
// with contiguous rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"
#include "ops.h"

namespace {

constexpr int64_t kGrainRows = 8;
constexpr int64_t kTile = 4;  // rows of x multiplied at once: one widened group of codes serves all of them
// kLanes codes as floats (GCC scalarizes __builtin_convertvector from int8: one instruction pair here instead)
inline vfloat widen(const int8_t* q) {
  vfloat v;
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  std::memcpy(&v, &w, sizeof(v));
#else
  for (int i = 0; i < kLanes; ++i) v[i] = q[i];
#endif
  return v;
}

// out[m, n] for one weight row n and rows m0..m0 + rows of x (fp32, [*, k]), rows <= kTile.
template <int64_t rows>
void int8_row_tile(const int8_t* q, const float* scale, const float* x, int64_t k, int64_t group, float* out,
                   int64_t out_stride) {
  vfloat acc[rows] = {};
  for (int64_t g = 0, g0 = 0; g0 < k; ++g, g0 += group) {  // no division in the loop: ~40 cycles a group
    vfloat sum[rows] = {};
    for (int64_t i = g0; i < g0 + group; i += kLanes) {
      const vfloat w = widen(q + i);
      for (int64_t m = 0; m < rows; ++m) sum[m] += w * load(x + m * k + i);
    }
    const vfloat s = splat(scale[g]);
    for (int64_t m = 0; m < rows; ++m) acc[m] += s * sum[m];
  }
  for (int64_t m = 0; m < rows; ++m) out[m * out_stride] = hsum(acc[m]);
}

void int8_row(const int8_t* q, const float* scale, const float* x, int64_t m_rows, int64_t k, int64_t group,
              float* out, int64_t n) {
  int64_t m = 0;
  for (; m + kTile <= m_rows; m += kTile) int8_row_tile<kTile>(q, scale, x + m * k, k, group, out + m * n, n);
  switch (m_rows - m) {
    case 3: int8_row_tile<3>(q, scale, x + m * k, k, group, out + m * n, n); break;
    case 2: int8_row_tile<2>(q, scale, x + m * k, k, group, out + m * n, n); break;
    case 1: int8_row_tile<1>(q, scale, x + m * k, k, group, out + m * n, n); break;
    default: break;
  }
}

// W^T rows [k0, k1) of one dtype: wt[k, r] = (code - 8) * scale + zero, sz = [k / 32, n_pad, 2] (scale, zero).
template <typename T>
void int4_rows_t(const uint8_t* packed, const T* sz, int64_t k, int64_t n_pad, int64_t k0, int64_t k1, T* wt) {
  for (int64_t kk = k0; kk < k1; ++kk) {
    for (int64_t block = 0; block < n_pad / 64; ++block) {
      const uint8_t* bytes = packed + (block * k + kk) * 32;
      const T* s = sz + ((kk / 32) * n_pad + block * 64) * 2;
      T* out = wt + kk * n_pad + block * 64;
      for (int64_t j = 0; j < 32; ++j) {
        out[j] = static_cast<T>((static_cast<float>(bytes[j] & 15) - 8.0f) * static_cast<float>(s[2 * j]) +
                                static_cast<float>(s[2 * j + 1]));
        out[32 + j] = static_cast<T>((static_cast<float>(bytes[j] >> 4) - 8.0f) * static_cast<float>(s[64 + 2 * j]) +
                                     static_cast<float>(s[64 + 2 * j + 1]));
      }
    }
  }
}

// W rows [r0, r1): w[r, i] = q[r, i] * scale[r, i / group].
template <typename T>
void int8_rows(const int8_t* q, const float* scale, int64_t k, int64_t group, int64_t r0, int64_t r1, T* w) {
  const int64_t groups = k / group;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scale[r * groups + g];
      for (int64_t i = r * k + g * group; i < r * k + (g + 1) * group; ++i) w[i] = static_cast<T>(q[i] * s);
    }
}

}  // namespace

at::Tensor int4_dequantize_t(const at::Tensor& packed, const at::Tensor& scale_zero) {
  const int64_t n_pad = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(packed.scalar_type() == at::kByte && n_pad % 64 == 0 && k % 32 == 0, "int4_dequantize_t: layout");
  TORCH_CHECK(scale_zero.sizes() == at::IntArrayRef({k / 32, n_pad, 2}), "int4_dequantize_t: scale_zero shape");
  const at::Tensor p = packed.contiguous(), sz = scale_zero.contiguous();
  at::Tensor wt = at::empty({k, n_pad}, scale_zero.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4_dequantize_t", [&] {
    const uint8_t* pp = p.data_ptr<uint8_t>();
    const scalar_t* sp = sz.data_ptr<scalar_t>();
    scalar_t* out = wt.data_ptr<scalar_t>();
    at::parallel_for(0, k, 16, [&](int64_t k0, int64_t k1) { int4_rows_t(pp, sp, k, n_pad, k0, k1, out); });
  });
  return wt;
}

at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype) {
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && k % scale.size(1) == 0,
              "int8_dequantize: int8 q, float32 scale");
  const at::Tensor qc = q.contiguous(), sc = scale.contiguous();
  at::Tensor w = at::empty({n, k}, q.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_dequantize", [&] {
    const int8_t* qp = qc.data_ptr<int8_t>();
    const float* sp = sc.data_ptr<float>();
    scalar_t* out = w.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) { int8_rows(qp, sp, k, k / sc.size(1), r0, r1, out); });
  });
  return w;
}

at::Tensor int8_group_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 2, "int8_group_linear: 2-d x, q and scale");
  TORCH_CHECK(q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "int8 q, float32 scale");
  const int64_t m_rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(q.size(1) == k && scale.size(0) == n && k % scale.size(1) == 0, "int8_group_linear: shapes");
  const int64_t group = k / scale.size(1);
  TORCH_CHECK(group % kLanes == 0, "int8_group_linear: the group size must be a multiple of ", kLanes);
  const at::Tensor xf = x.to(at::kFloat).contiguous(), qc = q.contiguous(), sc = scale.contiguous();
  at::Tensor out = at::empty({m_rows, n}, x.options().dtype(at::kFloat));
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float *sp = sc.data_ptr<float>(), *xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) int8_row(qp + r * k, sp + r * scale.size(1), xp, m_rows, k, group, op + r, n);
  });
  return out.to(x.scalar_type());
}
