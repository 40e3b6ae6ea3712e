// SwiGLU over rows [gate | up] of 2F (Megatron's --swiglu, every HF MoE family's experts): one pass forward and
// one backward instead of torch's chunk, silu, mul and their three backward ops.
//
// Forward, rounded where torch's two ops round:  s = round(silu(gate)),  y = round(s * up).
// Backward, from the rows and grad_y:  sig = sigmoid(gate),  s = round(gate * sig),
//   grad_up = round(grad_y * s),  grad_s = round(grad_y * up),
//   grad_gate = round(grad_s * sig * (1 + gate * (1 - sig)))   (torch's silu_backward)
// sigmoid from one exp of a non-positive argument (element_math.h): within an ulp or two of torch's fp32 values.
#include "moezero_ops.h"
#include "cpu_utils.h"
#include "element_math.h"
#include "row_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace moezero {
namespace {

using namespace element;

constexpr int64_t kBlock = 256;   // bf16 rows go in blocks: widen, compute in fp32, narrow

// sigmoid(x); 0 or 1 past |x| = 87 (exp_nonpositive's range), NaN for NaN
inline float sigmoid(float x) {
  const float v = std::fabs(x);
  const float e = v < 87.0f ? exp_nonpositive(-v) : 0.0f;
  const float inv = 1.0f / (1.0f + e);
  return x >= 0.0f ? inv : (x == x ? e * inv : x);
}

// silu's output rounded to T, and (for the backward) the sigmoid, of one gate value
template <typename T>
inline float rounded_silu(float g, float sig) {
  return round_to<T>(g * sig);
}

// fp32 rows in one loop (their roundings are the products'); bf16 rows in blocks: widen into fp32 buffers,
// compute, narrow (loops of one element type each vectorise; one loop loading bf16 and computing did not)
template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void forward_row(const T* gate, const T* up, T* y, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) y[i] = gate[i] * sigmoid(gate[i]) * up[i];
    return;
  }
  float gb[kBlock], ub[kBlock], yb[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t m = std::min(kBlock, n - begin);
    for (int64_t i = 0; i < m; ++i) gb[i] = load(gate, begin + i);
    for (int64_t i = 0; i < m; ++i) ub[i] = load(up, begin + i);
    for (int64_t i = 0; i < m; ++i) yb[i] = sigmoid(gb[i]);
    for (int64_t i = 0; i < m; ++i) yb[i] = rounded_silu<T>(gb[i], yb[i]) * ub[i];
    for (int64_t i = 0; i < m; ++i) store(y, begin + i, yb[i]);
  }
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void backward_row(const T* grad_y, const T* gate, const T* up, T* grad_gate,
                                               T* grad_up, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) {
      const float g = gate[i], dy = grad_y[i], sig = sigmoid(g);
      grad_up[i] = dy * (g * sig);
      grad_gate[i] = dy * up[i] * sig * (1.0f + g * (1.0f - sig));
    }
    return;
  }
  float db[kBlock], gb[kBlock], ub[kBlock], ggb[kBlock], gub[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t m = std::min(kBlock, n - begin);
    for (int64_t i = 0; i < m; ++i) db[i] = load(grad_y, begin + i);
    for (int64_t i = 0; i < m; ++i) gb[i] = load(gate, begin + i);
    for (int64_t i = 0; i < m; ++i) ub[i] = load(up, begin + i);
    for (int64_t i = 0; i < m; ++i) ggb[i] = sigmoid(gb[i]);
    for (int64_t i = 0; i < m; ++i) {
      const float g = gb[i], dy = db[i], sig = ggb[i];
      gub[i] = dy * rounded_silu<T>(g, sig);
      const float grad_s = round_to<T>(dy * ub[i]);
      ggb[i] = grad_s * sig * (1.0f + g * (1.0f - sig));   // torch's silu_backward, its order of the products
    }
    for (int64_t i = 0; i < m; ++i) store(grad_gate, begin + i, ggb[i]);
    for (int64_t i = 0; i < m; ++i) store(grad_up, begin + i, gub[i]);
  }
}

template <typename T>
void forward_rows(const at::Tensor& h, at::Tensor& y) {
  const int64_t rows = h.size(0), n = y.size(1);
  const T* hp = h.data_ptr<T>();
  T* yp = y.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) forward_row<T>(hp + r * 2 * n, hp + r * 2 * n + n, yp + r * n, n);
}

template <typename T>
void backward_rows(const at::Tensor& grad_y, const at::Tensor& h, at::Tensor& grad_h) {
  const int64_t rows = h.size(0), n = grad_y.size(1);
  const T* gp = grad_y.data_ptr<T>();
  const T* hp = h.data_ptr<T>();
  T* dp = grad_h.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = r * 2 * n;
    backward_row<T>(gp + r * n, hp + at, hp + at + n, dp + at, dp + at + n, n);
  }
}

}  // namespace

at::Tensor swiglu(const at::Tensor& h_M2F) {
  check_rows(h_M2F, "swiglu", "h_M2F");
  TORCH_CHECK(h_M2F.size(1) % 2 == 0, "swiglu: h_M2F's width ", h_M2F.size(1), " is not [gate | up] (odd)");
  at::Tensor y = at::empty({h_M2F.size(0), h_M2F.size(1) / 2}, h_M2F.options());
  if (h_M2F.scalar_type() == at::kFloat) {
    forward_rows<float>(h_M2F, y);
  } else {
    forward_rows<c10::BFloat16>(h_M2F, y);
  }
  return y;
}

at::Tensor swiglu_backward(const at::Tensor& grad_MF, const at::Tensor& h_M2F) {
  check_rows(grad_MF, "swiglu_backward", "grad_MF");
  check_rows(h_M2F, "swiglu_backward", "h_M2F");
  TORCH_CHECK(grad_MF.scalar_type() == h_M2F.scalar_type() && grad_MF.size(0) == h_M2F.size(0) &&
                  2 * grad_MF.size(1) == h_M2F.size(1),
              "swiglu_backward: grad_MF must be h_M2F's rows at half its width, in its dtype");
  at::Tensor grad_h = at::empty_like(h_M2F);
  if (h_M2F.scalar_type() == at::kFloat) {
    backward_rows<float>(grad_MF, h_M2F, grad_h);
  } else {
    backward_rows<c10::BFloat16>(grad_MF, h_M2F, grad_h);
  }
  return grad_h;
}

}  // namespace moezero
