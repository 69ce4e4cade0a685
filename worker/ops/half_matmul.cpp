// fp32 activations times weights kept in 16 bits (worker/model/linear_method.py's HalfLinear): a checkpoint's bf16 or
// fp16 values, exact, so the product is the fp32 model's up to the order of the fp32 additions, while every call
// reads half the bytes of an fp32 copy. Each value widens to fp32 in a register (bf16: a shift; fp16: F16C).
//
// The weight [n, k] is packed once into panels of P = 2 vectors of output rows, [n_pad / P, k, P]: a panel's values
// for one input k are one vector load apart, so a tile of R rows of x times a panel is R broadcasts and 2R FMAs an
// input, the 2R sums in registers (R <= 6 leaves 3 of AVX2's 16 for the weights and x). Panels are split across
// threads (one parallel region a call); each thread takes x in blocks of rows that stay in L2 while its panels pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace {

constexpr int64_t kPanel = 2 * kLanes;
constexpr int kMaxTile = 6;
constexpr int64_t kRowBlockBytes = 256 * 1024;  // x's rows in L2 while every panel passes

inline vfloat widen(const c10::BFloat16* p) { return load_bf16(p); }
inline vfloat widen(const c10::Half* p) { return load(p); }

// out[r, j] for rows r < R of x and the panel's columns j < cols; U independent sums a column (U = 2 at one or two
// rows: the FMA latency, not the loads, would bound a single chain).
template <int R, int U, typename T>
void tile(const T* panel, const float* x, int64_t k, const float* bias, float* out, int64_t n, int64_t cols) {
  vfloat acc[U][R][2] = {};
  int64_t kk = 0;
  for (; kk + U <= k; kk += U) {
    for (int u = 0; u < U; ++u) {
      const vfloat w0 = widen(panel + (kk + u) * kPanel), w1 = widen(panel + (kk + u) * kPanel + kLanes);
      for (int r = 0; r < R; ++r) {
        const vfloat a = splat(x[r * k + kk + u]);
        acc[u][r][0] += a * w0;
        acc[u][r][1] += a * w1;
      }
    }
  }
  for (; kk < k; ++kk) {
    const vfloat w0 = widen(panel + kk * kPanel), w1 = widen(panel + kk * kPanel + kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat a = splat(x[r * k + kk]);
      acc[0][r][0] += a * w0;
      acc[0][r][1] += a * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) {
      acc[0][r][0] += acc[u][r][0];
      acc[0][r][1] += acc[u][r][1];
    }
    float sums[kPanel];
    store(sums, acc[0][r][0]);
    store(sums + kLanes, acc[0][r][1]);
    for (int64_t j = 0; j < cols; ++j) out[r * n + j] = bias == nullptr ? sums[j] : sums[j] + bias[j];
  }
}

// Rows [0, m) of x times one panel, kMaxTile rows at a time.
template <typename T>
void panel_rows(const T* panel, const float* x, int64_t m, int64_t k, const float* bias, float* out, int64_t n,
                int64_t cols) {
  int64_t i = 0;
  for (; i + kMaxTile <= m; i += kMaxTile) tile<kMaxTile, 1>(panel, x + i * k, k, bias, out + i * n, n, cols);
  const float* xi = x + i * k;
  float* oi = out + i * n;
  switch (m - i) {
    case 5: tile<5, 1>(panel, xi, k, bias, oi, n, cols); break;
    case 4: tile<4, 1>(panel, xi, k, bias, oi, n, cols); break;
    case 3: tile<3, 1>(panel, xi, k, bias, oi, n, cols); break;
    case 2: tile<2, 2>(panel, xi, k, bias, oi, n, cols); break;
    case 1: tile<1, 2>(panel, xi, k, bias, oi, n, cols); break;
    default: break;
  }
}

}  // namespace

at::Tensor half_pack(const at::Tensor& weight, at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kHalf), "half_pack: a 2-d weight, to "
              "bfloat16 or float16");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor rows = at::zeros({panels * kPanel, k}, weight.options().dtype(dtype));
  rows.narrow(0, 0, n).copy_(weight);
  return rows.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "half_linear: fp32 x [..., k]");
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(k, 1), panels = packed.size(0);
  const bool half = packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kHalf;
  TORCH_CHECK(packed.dim() == 3 && half && packed.size(1) == k && packed.size(2) == kPanel &&
                  panels * kPanel >= n && n > panels * kPanel - kPanel && packed.is_contiguous(),
              "half_linear: the weight as half_pack packs it, [ceil(n / ", kPanel, "), k, ", kPanel, "]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == n), "half_linear: fp32 bias [n]");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  const float *xp = xc.data_ptr<float>(), *bp = bias ? bc.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t block = std::max<int64_t>(kMaxTile, kRowBlockBytes / (k * 4) / kMaxTile * kMaxTile);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(packed.scalar_type(), "half_linear", [&] {
    const scalar_t* wp = packed.data_ptr<scalar_t>();
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {  // one region a call: no barrier a row block
      for (int64_t m0 = 0; m0 < m; m0 += block) {
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t c0 = p * kPanel;
          panel_rows(wp + p * k * kPanel, xp + m0 * k, std::min(block, m - m0), k, bp == nullptr ? nullptr : bp + c0,
                     op + m0 * n + c0, n, std::min(kPanel, n - c0));
        }
      }
    });
  });
  return out;
}
