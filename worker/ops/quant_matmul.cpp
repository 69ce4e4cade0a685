// Weight-only int8 matmul for small batches (decode): W[n, k] = q[n, k] * scale[n, k / group], read once as int8
// (a GGUF Q8_0 tensor: group 32; --quantization rtn: group 128), so a decode step reads half the bytes of bf16.
// Each group's codes are widened to fp32 once and multiplied with every row of x; sums in fp32, one rounding to
// x's dtype at the end. Large batches do not come here: they dequantize and use the dense GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace {

constexpr int64_t kGrainRows = 8;

// out[m, n] for one weight row n and every row m of x (fp32, [m_rows, k]); wf: a group of widened codes.
void int8_row(const int8_t* q, const float* scale, const float* x, int64_t m_rows, int64_t k, int64_t group,
              float* wf, vfloat* acc, float* out, int64_t out_stride) {
  for (int64_t m = 0; m < m_rows; ++m) acc[m] = vfloat{};
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    for (int64_t i = 0; i < group; ++i) wf[i] = static_cast<float>(q[g0 + i]);
    const vfloat s = splat(scale[g0 / group]);
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xm = x + m * k + g0;
      vfloat sum{};
      for (int64_t i = 0; i < group; i += kLanes) sum += load(wf + i) * load(xm + i);
      acc[m] += s * sum;
    }
  }
  for (int64_t m = 0; m < m_rows; ++m) out[m * out_stride] = hsum(acc[m]);
}

}  // namespace

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
    std::vector<float> wf(group);
    std::vector<vfloat> acc(m_rows);
    for (int64_t r = begin; r < end; ++r)
      int8_row(qp + r * k, sp + r * scale.size(1), xp, m_rows, k, group, wf.data(), acc.data(), op + r, n);
  });
  return out.to(x.scalar_type());
}
