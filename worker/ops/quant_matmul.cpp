// Weight-only quantized matmuls (worker/ops/quant_linear.py).
//
// int8_group_linear, small batches (decode): W[n, k] = q[n, k] * scale[n, k / group], read once as int8 (a GGUF
// Q8_0 tensor: group 32; --quantization rtn: group 128), so a decode step reads half the bytes of bf16. Each
// group's codes are widened to fp32 once and multiplied with every row of x; sums in fp32, one rounding to x's
// dtype at the end.
//
// int4_group_linear, small batches of fp32 activations: torch's packed int4 layout (below) read in place, a block of
// output rows at a time; each input's codes are widened to fp32 in registers and multiplied with one or two rows of x
// (no scratch: at batch 1 the widening and the FMAs are the whole cost), and w = q * scale + min is applied per group
// of 32 inputs as scale * sum x q + min * sum x. Its (scale, min) pairs are blocked, [n_pad / B, k / 32, B, 2]: a
// block's are one sequential stream beside its codes, not k / 32 strided pieces of torch's [k / 32, n_pad, 2]
// (SmolLM2-135M's int4 linears at batch 1, weights in DRAM: 1.17x); fp16 where that is exact (GGUF Q4_0 and Q4_1
// store fp16 scales and mins), a sixth fewer bytes a weight than fp32. Torch's own packed int4 matmul has no
// vectorized fp32 path on AVX2 CPUs (measured 25-40x slower than for bf16 there).
//
// int4_dequantize_t and int8_dequantize, large batches (prefill): the weight in the activations' dtype, in one
// pass, for the dense GEMM. Torch's packed int4 layout holds, for each block of B output rows and each input k,
// B / 2 bytes; which rows a byte's nibbles hold depends on the CPU (B 64 on AVX512, 32 elsewhere), so the kernels
// take the block's row order (quant_linear.int4_row_order: entry 2j + h is the row of byte j's nibble h). The
// transposed weight [k, n] is written with contiguous rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <vector>

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
#elif defined(__AVX2__)
  const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
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

// kLanes bytes as int32 lanes.
inline vint widen_u8(const uint8_t* p) {
  vint v;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &w, sizeof(v));
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &w, sizeof(v));
#else
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
#endif
  return v;
}

constexpr int kInt4Group = 32, kMaxBlock = 64;  // inputs per scale; the most output rows of a packed block

template <size_t... I>
inline vfloat evens(vfloat a, vfloat b, std::index_sequence<I...>) { return __builtin_shufflevector(a, b, (2 * I)...); }
template <size_t... I>
inline vfloat odds(vfloat a, vfloat b, std::index_sequence<I...>) { return __builtin_shufflevector(a, b, (2 * I + 1)...); }

// Rows m0..m0 + M of x (M <= 2: the sums stay in registers) times one block of B output rows. A block is computed in
// the packed bytes' own order, nibble h of byte j at position h * B / 2 + j, so codes widen by whole vectors straight
// into the multiply. On AVX2 and AVX512 position p is row p (row == nullptr): scales load and sums store as vectors;
// in the other layout they go through row[p]. sm: the block's (scale, min) pairs [k / 32, B, 2], S float or fp16;
// sum_x: x's sums per group of 32 inputs, [rows of x, k / 32].
template <int B, int M, typename S>
void int4_tile(const uint8_t* bytes, const S* sm, const int* row, const float* x, const float* sum_x, int64_t k,
               int64_t n_pad, float* out) {
  constexpr int kVecs = B / kLanes, kHalf = B / 2, kHalfVecs = kVecs / 2;
  static_assert(kHalf % kLanes == 0, "a packed row of bytes widens by whole vectors");
  constexpr auto kIdx = std::make_index_sequence<kLanes>{};
  vfloat acc[M][kVecs] = {};
  for (int64_t g = 0; g < k / kInt4Group; ++g) {
    vfloat dot[M][kVecs] = {};
    for (int kk = 0; kk < kInt4Group; ++kk) {
      const uint8_t* b = bytes + (g * kInt4Group + kk) * kHalf;
      vfloat lo[kHalfVecs], hi[kHalfVecs];
      for (int j = 0; j < kHalfVecs; ++j) {
        const vint w = widen_u8(b + j * kLanes);
        lo[j] = __builtin_convertvector(w & 15, vfloat);
        hi[j] = __builtin_convertvector(w >> 4, vfloat);
      }
      for (int m = 0; m < M; ++m) {
        const vfloat xv = splat(x[m * k + g * kInt4Group + kk]);
        for (int j = 0; j < kHalfVecs; ++j) {
          dot[m][j] += xv * lo[j];
          dot[m][kHalfVecs + j] += xv * hi[j];
        }
      }
    }
    const S* s = sm + g * B * 2;  // (scale, min) pairs of this group, from the block's first row
    for (int v = 0; v < kVecs; ++v) {
      vfloat scale, min;
      if (row == nullptr) {
        const vfloat a = load(s + v * 2 * kLanes), c = load(s + v * 2 * kLanes + kLanes);
        scale = evens(a, c, kIdx);
        min = odds(a, c, kIdx);
      } else {
        for (int l = 0; l < kLanes; ++l) {
          scale[l] = to_float(s[2 * row[v * kLanes + l]]);
          min[l] = to_float(s[2 * row[v * kLanes + l] + 1]);
        }
      }
      for (int m = 0; m < M; ++m) {  // w = q * scale + min, summed over the group
        acc[m][v] += scale * dot[m][v] + min * sum_x[m * (k / kInt4Group) + g];
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < kVecs; ++v) {
      if (row == nullptr) {
        store(out + m * n_pad + v * kLanes, acc[m][v]);
      } else {
        for (int l = 0; l < kLanes; ++l) out[m * n_pad + row[v * kLanes + l]] = acc[m][v][l];
      }
    }
}

// Every row of x times one block: x two rows at a time, the block's bytes (16 or 32 per input) re-read from cache.
template <int B, typename S>
void int4_block(const uint8_t* packed, const S* sm, const int* row, const float* x, const float* sum_x,
                int64_t m_rows, int64_t k, int64_t n_pad, int64_t block, float* out) {
  const uint8_t* bytes = packed + block * k * (B / 2);
  const int64_t groups = k / kInt4Group;
  const S* s = sm + block * groups * B * 2;
  int64_t m = 0;
  for (; m + 2 <= m_rows; m += 2)
    int4_tile<B, 2>(bytes, s, row, x + m * k, sum_x + m * groups, k, n_pad, out + m * n_pad + block * B);
  if (m < m_rows) int4_tile<B, 1>(bytes, s, row, x + m * k, sum_x + m * groups, k, n_pad, out + m * n_pad + block * B);
}

// The row of each position of a block in this order; empty (nothing allocated: every decode call asks) where
// position p is row p.
std::vector<int> positions(const int32_t* order, int B) {
  bool identity = true;
  for (int j = 0; j < B / 2; ++j) identity = identity && order[2 * j] == j && order[2 * j + 1] == B / 2 + j;
  if (identity) return {};
  std::vector<int> row(B);
  for (int j = 0; j < B / 2; ++j) {
    row[j] = order[2 * j];
    row[B / 2 + j] = order[2 * j + 1];
  }
  return row;
}

// W^T rows [k0, k1): wt[k, r] = (code - shift) * scale + offset, the (scale, offset) pairs of a block's first row at
// sz + group * group_stride + block * block_stride; blocks of B rows in the given row order. Torch's layout:
// (scale, zero), shift 8; the blocked one: (scale, min), shift 0.
template <typename T, typename S>
void int4_rows_t(const uint8_t* packed, const S* sz, const int32_t* order, int64_t B, int64_t k, int64_t n_pad,
                 int64_t group_stride, int64_t block_stride, float shift, int64_t k0, int64_t k1, T* wt) {
  for (int64_t kk = k0; kk < k1; ++kk) {
    for (int64_t block = 0; block < n_pad / B; ++block) {
      const uint8_t* bytes = packed + (block * k + kk) * (B / 2);
      const S* s = sz + (kk / kInt4Group) * group_stride + block * block_stride;
      T* out = wt + kk * n_pad + block * B;
      for (int64_t i = 0; i < B; ++i) {
        const int r = order[i];
        const float code = static_cast<float>(i % 2 ? bytes[i / 2] >> 4 : bytes[i / 2] & 15);
        out[r] = static_cast<T>((code - shift) * to_float(s[2 * r]) + to_float(s[2 * r + 1]));
      }
    }
  }
}

bool is_scale_min_dtype(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf; }

// f(the data of blocked (scale, min) pairs), typed: const c10::Half* or const float*.
template <typename F>
void with_scale_min(const at::Tensor& t, F f) {
  if (t.scalar_type() == at::kHalf) {
    f(t.data_ptr<c10::Half>());
  } else {
    f(t.data_ptr<float>());
  }
}

// The row order of torch's packed int4 blocks, checked: B = its length, 32 or 64, dividing n_pad.
const int32_t* row_order(const at::Tensor& order, int64_t n_pad) {
  const int64_t B = order.numel();
  TORCH_CHECK(order.scalar_type() == at::kInt && order.is_contiguous() && (B == 32 || B == kMaxBlock) && n_pad % B == 0,
              "int4: the row order is int32 [32] or [64] and divides the padded rows");
  return order.data_ptr<int32_t>();
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

at::Tensor int4_dequantize_t(const at::Tensor& packed, const at::Tensor& scale_zero, const at::Tensor& order) {
  const int64_t n_pad = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(packed.scalar_type() == at::kByte && k % kInt4Group == 0, "int4_dequantize_t: layout");
  const int32_t* rows = row_order(order, n_pad);
  const int64_t B = order.numel(), groups = k / kInt4Group;
  const bool blocked = scale_zero.dim() == 4;
  const std::vector<int64_t> shape = blocked ? std::vector<int64_t>{n_pad / B, groups, B, 2}
                                             : std::vector<int64_t>{groups, n_pad, 2};
  TORCH_CHECK(scale_zero.sizes().vec() == shape && (!blocked || is_scale_min_dtype(scale_zero)),
              "int4_dequantize_t: (scale, zero) [k / 32, n_pad, 2], or (scale, min) blocked [n_pad / B, k / 32, B, 2] "
              "in float32 or float16");
  const int64_t group_stride = blocked ? B * 2 : n_pad * 2, block_stride = blocked ? groups * B * 2 : B * 2;
  const at::Tensor p = packed.contiguous(), sz = scale_zero.contiguous();
  const uint8_t* pp = p.data_ptr<uint8_t>();
  if (blocked) {  // the fp32 path's weights: float32 out
    at::Tensor wt = at::empty({k, n_pad}, scale_zero.options().dtype(at::kFloat));
    float* out = wt.data_ptr<float>();
    with_scale_min(sz, [&](auto sp) {
      at::parallel_for(0, k, 16, [&](int64_t k0, int64_t k1) {
        int4_rows_t(pp, sp, rows, B, k, n_pad, group_stride, block_stride, 0.0f, k0, k1, out);
      });
    });
    return wt;
  }
  at::Tensor wt = at::empty({k, n_pad}, scale_zero.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sz.scalar_type(), "int4_dequantize_t", [&] {
    const scalar_t* sp = sz.data_ptr<scalar_t>();
    scalar_t* out = wt.data_ptr<scalar_t>();
    at::parallel_for(0, k, 16, [&](int64_t k0, int64_t k1) {
      int4_rows_t(pp, sp, rows, B, k, n_pad, group_stride, block_stride, 8.0f, k0, k1, out);
    });
  });
  return wt;
}

at::Tensor int4_group_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale_min,
                             const at::Tensor& order) {
  const int64_t n_pad = packed.size(0), k = packed.size(1) * 2, m_rows = x.size(0), B = order.numel();
  TORCH_CHECK(packed.scalar_type() == at::kByte && k % kInt4Group == 0, "int4_group_linear: layout");
  const int32_t* rows = row_order(order, n_pad);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat, "int4_group_linear: fp32 x [m, k]");
  TORCH_CHECK(scale_min.sizes() == at::IntArrayRef({n_pad / B, k / kInt4Group, B, 2}) && is_scale_min_dtype(scale_min),
              "int4_group_linear: (scale, min) [n_pad / B, k / 32, B, 2] in float32 or float16");
  const at::Tensor xc = x.contiguous(), p = packed.contiguous(), sm = scale_min.contiguous();
  at::Tensor out = at::empty({m_rows, n_pad}, x.options());
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  std::vector<float> sum_x(m_rows * k / kInt4Group, 0.0f);  // [m, k / 32]
  for (int64_t i = 0; i < m_rows * k; ++i) sum_x[i / kInt4Group] += xp[i];
  const float* sxp = sum_x.data();
  float* op = out.data_ptr<float>();
  const std::vector<int> row = positions(rows, B);
  const int* rp = row.empty() ? nullptr : row.data();
  with_scale_min(sm, [&](auto sp) {
    at::parallel_for(0, n_pad / B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (B == kMaxBlock) {
          int4_block<kMaxBlock>(pp, sp, rp, xp, sxp, m_rows, k, n_pad, b, op);
        } else {
          int4_block<32>(pp, sp, rp, xp, sxp, m_rows, k, n_pad, b, op);
        }
      }
    });
  });
  return out;
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
