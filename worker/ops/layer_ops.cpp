// A decoder layer's elementwise work in one pass each, with the rounding of the torch ops they replace
// (worker/model/layers.py): math in fp32, a result rounded to the tensor's dtype wherever torch's op
// sequence rounds it. The torch ops (about 50 per layer) cost more in dispatch than in arithmetic at
// decode batch sizes, and each pass over a prefill's activations costs memory bandwidth.
//
// No fused multiply-add here: torch computes a * b + c with two roundings, and so must this file for
// float32 results equal to transformers'.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"
#include "ops.h"

namespace {

constexpr int64_t kGrainTokens = 16;

// v rounded to T and back: the value a torch op would hand to the next one.
template <typename T>
inline void round_to(float* v, int64_t n, std::vector<T>& scratch) {
  if constexpr (!std::is_same_v<T, float>) {
    from_float(v, scratch.data(), n);
    to_float(scratch.data(), v, n);
  }
}

// The sum of v[i]^2, kLanes partial sums at a time.
inline float sum_squares(const float* v, int64_t n) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(v + i) * load(v + i);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += v[i] * v[i];
  return sum;
}

// v = v / (1 + exp(-v)) in place; exp only of non-positive arguments: for v < 0 it is v e / (1 + e), e = exp(v).
inline void silu(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vfloat x = load(v + i);
    const vfloat e = exp_nonpos(x > 0 ? -x : x);
    store(v + i, (x >= 0 ? x : x * e) / (1.0f + e));  // one division for both signs
  }
  for (; i < n; ++i) v[i] = v[i] >= 0 ? v[i] / (1.0f + std::exp(-v[i])) : v[i] * std::exp(v[i]) / (1.0f + std::exp(v[i]));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name, " must be a CPU [tokens, n] tensor");
}

// out = weight * T(x / sqrt(mean(x^2) + eps)), a row at a time; with delta, x = T(x + delta) first, in place.
template <typename T>
void norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t n, int64_t x_stride,
               int64_t delta_stride, float eps) {
  at::parallel_for(0, rows, kGrainTokens, [&](int64_t begin, int64_t end) {
    std::vector<float> h(n), w(n), d(delta ? n : 0);
    std::vector<T> scratch(n);
    to_float(weight, w.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * x_stride, h.data(), n);
      if (delta) {
        to_float(delta + r * delta_stride, d.data(), n);
        for (int64_t i = 0; i < n; ++i) h[i] += d[i];
        round_to(h.data(), n, scratch);
        from_float(h.data(), x + r * x_stride, n);
      }
      const float sum = sum_squares(h.data(), n);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) h[i] *= inv;
      round_to(h.data(), n, scratch);
      for (int64_t i = 0; i < n; ++i) h[i] *= w[i];
      from_float(h.data(), out + r * n, n);
    }
  });
}

at::Tensor norm(at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [n] tensor of x's dtype");
  if (delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(), "delta must be like x");
  }
  auto out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta ? delta->data_ptr<scalar_t>() : nullptr,
                        weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.stride(0),
                        delta ? delta->stride(0) : 0, static_cast<float>(eps));
  });
  return out;
}

// x[h] (h < D/2) = x[h] cos[h] - x[h + D/2] sin[h]; x[h + D/2] = x[h + D/2] cos[h + D/2] + x[h] sin[h + D/2].
template <typename T>
void rotate(T* x, int64_t tokens, int64_t heads, int64_t D, int64_t token_stride, int64_t head_stride,
            const int64_t* pos, const float* cos, const float* sin) {
  at::parallel_for(0, tokens, kGrainTokens, [&](int64_t begin, int64_t end) {
    std::vector<float> v(D), out(D);
    std::vector<T> scratch(D);
    const int64_t half = D / 2;
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * D;
      const float* s = sin + pos[t] * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* head = x + t * token_stride + h * head_stride;
        to_float(head, v.data(), D);
        for (int64_t i = 0; i < half; ++i) {
          out[i] = v[i] * c[i] - v[i + half] * s[i];
          out[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
        }
        from_float(out.data(), head, D);
      }
    }
  });
}

// out[t] = T(T(silu(g)) * u) for g, u the two halves of x[t]; silu(g) = g / (1 + exp(-g)).
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t n, int64_t x_stride) {
  at::parallel_for(0, rows, kGrainTokens, [&](int64_t begin, int64_t end) {
    std::vector<float> g(n), u(n);
    std::vector<T> scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * x_stride, g.data(), n);
      to_float(x + r * x_stride + n, u.data(), n);
      silu(g.data(), n);
      round_to(g.data(), n, scratch);
      for (int64_t i = 0; i < n; ++i) g[i] *= u[i];
      from_float(g.data(), out + r * n, n);
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor input = x;
  return norm(input, nullptr, weight, eps);
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm(x, &delta, weight, eps);
}

void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(positions.is_cpu() && positions.dtype() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0) && positions.numel() == k.size(0),
              "positions must be a contiguous int64 [tokens] tensor");
  TORCH_CHECK(cos.dtype() == at::kFloat && sin.dtype() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == q.size(2),
              "cos and sin must be contiguous float32 [max_positions, head_size] tables");
  if (positions.numel() > 0) {
    const auto [lo, hi] = at::aminmax(positions);
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < cos.size(0), "a position is outside the table");
  }
  for (at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->is_cpu() && t->dim() == 3 && t->stride(2) == 1 && t->size(2) == cos.size(1) &&
                    t->size(2) % 2 == 0 && t->scalar_type() == q.scalar_type(),
                "q and k must be CPU [tokens, heads, head_size] tensors of one dtype, head_size even");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t->scalar_type(), "rotary_cpu", [&] {
      rotate<scalar_t>(t->data_ptr<scalar_t>(), t->size(0), t->size(1), t->size(2), t->stride(0), t->stride(1),
                       positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
    });
  }
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even");
  const int64_t n = x.size(1) / 2;
  auto out = at::empty({x.size(0), n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul_cpu", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), n, x.stride(0));
  });
  return out;
}
