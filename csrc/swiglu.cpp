// SwiGLU over rows [gate | up] of 2F (Megatron's --swiglu, every HF MoE family's experts): one pass forward and
// one backward instead of torch's chunk, silu, mul and their three backward ops.
//
// Forward, rounded where torch's two ops round:  s = round(silu(gate)),  y = round(s * up).
// Backward, from the rows and grad_y:  sig = sigmoid(gate),  s = round(gate * sig),
//   grad_up = round(grad_y * s),  grad_s = round(grad_y * up),
//   grad_gate = round(grad_s * sig * (1 + gate * (1 - sig)))   (torch's silu_backward)
// sigmoid from one exp of a non-positive argument (element_math.h): within an ulp or two of torch's fp32 values.
//
// GPT-OSS's quick GEGLU (Megatron's --quick-geglu --glu-linear-offset o --activation-func-clamp-value c), rounded
// where torch's chain of ops rounds (clamps, alpha * gate, sigmoid, product, up + offset, product), c and o rounded
// to the rows' dtype first as torch's clamp and add round them (alpha stays fp32):
//   g = min(gate, c),  u = clamp(up, -c, c),  t = round(alpha g),  s = round(sigmoid(t)),  a = round(g s),
//   y = round(a * round(u + o))
// and its backward as autograd runs that chain: grad_a = round(dy u1), grad_u = round(dy a) where up is within
// [-c, c] (else 0); grad_gate = round(round(grad_a s) + round(round(round(grad_a g) (1 - s) s) alpha)) where
// gate <= c (else 0). Without a clamp nothing is masked; without an offset u1 = u.
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
#include <limits>
#include <optional>
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

// GPT-OSS's quick GEGLU parameters (see the top); without a clamp, clamp is +inf (the same values, no branch)
struct QuickGeglu {
  float alpha, offset, clamp;
  bool clamped;
};

// The element loops below take the parameters as plain floats and select without short-circuits: loops with
// control flow or a parameter read through a reference did not vectorise.
inline float clamp_gate(float g, float c) { return g > c ? c : g; }

inline float clamp_up(float u, float c) { return u < -c ? -c : (u > c ? c : u); }

// u + offset rounded to T; u itself without an offset (torch's chain multiplies by up then)
template <typename T>
inline float offset_up(float u, float offset) {
  const float shifted = round_to<T>(u + offset);
  return offset != 0.0f ? shifted : u;
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void geglu_forward_row(const T* gate, const T* up, T* y, int64_t n, QuickGeglu p) {
  const float alpha = p.alpha, offset = p.offset, c = p.clamp;
  float gb[kBlock], ub[kBlock], sb[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t m = std::min(kBlock, n - begin);
    for (int64_t i = 0; i < m; ++i) gb[i] = load(gate, begin + i);
    for (int64_t i = 0; i < m; ++i) ub[i] = load(up, begin + i);
    for (int64_t i = 0; i < m; ++i) gb[i] = clamp_gate(gb[i], c);
    for (int64_t i = 0; i < m; ++i) ub[i] = offset_up<T>(clamp_up(ub[i], c), offset);
    for (int64_t i = 0; i < m; ++i) sb[i] = round_to<T>(sigmoid(round_to<T>(gb[i] * alpha)));
    for (int64_t i = 0; i < m; ++i) sb[i] = round_to<T>(gb[i] * sb[i]) * ub[i];
    for (int64_t i = 0; i < m; ++i) store(y, begin + i, sb[i]);
  }
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void geglu_backward_row(const T* grad_y, const T* gate, const T* up, T* grad_gate,
                                                     T* grad_up, int64_t n, QuickGeglu p) {
  const float alpha = p.alpha, offset = p.offset, c = p.clamp;
  const bool unclamped = !p.clamped;   // nothing masked: a NaN's gradient stays NaN, as without torch's clamps
  float db[kBlock], gb[kBlock], ub[kBlock], sb[kBlock], ggb[kBlock], gub[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t m = std::min(kBlock, n - begin);
    for (int64_t i = 0; i < m; ++i) db[i] = load(grad_y, begin + i);
    for (int64_t i = 0; i < m; ++i) gb[i] = load(gate, begin + i);
    for (int64_t i = 0; i < m; ++i) ub[i] = load(up, begin + i);
    for (int64_t i = 0; i < m; ++i) sb[i] = round_to<T>(sigmoid(round_to<T>(clamp_gate(gb[i], c) * alpha)));
    for (int64_t i = 0; i < m; ++i) {
      const float g = clamp_gate(gb[i], c), u = ub[i], dy = db[i], s = sb[i];
      const float a = round_to<T>(g * s), grad_a = round_to<T>(dy * offset_up<T>(clamp_up(u, c), offset));
      const float grad_t = round_to<T>(round_to<T>(grad_a * g) * (1.0f - s) * s);   // torch's sigmoid_backward
      const float grad_g = round_to<T>(round_to<T>(grad_a * s) + round_to<T>(grad_t * alpha));
      ggb[i] = (gb[i] <= c) | unclamped ? grad_g : 0.0f;
      gub[i] = ((u >= -c) & (u <= c)) | unclamped ? dy * a : 0.0f;
    }
    for (int64_t i = 0; i < m; ++i) store(grad_gate, begin + i, ggb[i]);
    for (int64_t i = 0; i < m; ++i) store(grad_up, begin + i, gub[i]);
  }
}

// row(gate, up, y, n) over every row of [gate | up]
template <typename T, typename Row>
void forward_rows(const at::Tensor& h, at::Tensor& y, Row row) {
  const int64_t rows = h.size(0), n = y.size(1);
  const T* hp = h.data_ptr<T>();
  T* yp = y.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) row(hp + r * 2 * n, hp + r * 2 * n + n, yp + r * n, n);
}

// row(grad_y, gate, up, grad_gate, grad_up, n) over every row
template <typename T, typename Row>
void backward_rows(const at::Tensor& grad_y, const at::Tensor& h, at::Tensor& grad_h, Row row) {
  const int64_t rows = h.size(0), n = grad_y.size(1);
  const T* gp = grad_y.data_ptr<T>();
  const T* hp = h.data_ptr<T>();
  T* dp = grad_h.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = r * 2 * n;
    row(gp + r * n, hp + at, hp + at + n, dp + at, dp + at + n, n);
  }
}

void check_gated_rows(const at::Tensor& h_M2F, const char* op) {
  check_rows(h_M2F, op, "h_M2F");
  TORCH_CHECK(h_M2F.size(1) % 2 == 0, op, ": h_M2F's width ", h_M2F.size(1), " is not [gate | up] (odd)");
}

void check_gated_grad(const at::Tensor& grad_MF, const at::Tensor& h_M2F, const char* op) {
  check_rows(grad_MF, op, "grad_MF");
  check_rows(h_M2F, op, "h_M2F");
  TORCH_CHECK(grad_MF.scalar_type() == h_M2F.scalar_type() && grad_MF.size(0) == h_M2F.size(0) &&
                  2 * grad_MF.size(1) == h_M2F.size(1),
              op, ": grad_MF must be h_M2F's rows at half its width, in its dtype");
}

// The parameters as torch's ops meet them: alpha * gate multiplies by alpha in fp32 (a Python float against
// float32 or bfloat16 rows), while clamp and + offset first round their bound and offset to the rows' dtype
template <typename T>
QuickGeglu geglu_parameters(double alpha, double offset, std::optional<double> clamp) {
  TORCH_CHECK(!clamp || *clamp >= 0.0, "quick_geglu: clamp ", clamp.value_or(0.0), " must be >= 0");
  const float bound = clamp ? round_to<T>(static_cast<float>(*clamp)) : std::numeric_limits<float>::infinity();
  return {static_cast<float>(alpha), round_to<T>(static_cast<float>(offset)), bound, clamp.has_value()};
}

}  // namespace

at::Tensor swiglu(const at::Tensor& h_M2F) {
  check_gated_rows(h_M2F, "swiglu");
  at::Tensor y = at::empty({h_M2F.size(0), h_M2F.size(1) / 2}, h_M2F.options());
  if (h_M2F.scalar_type() == at::kFloat) {
    forward_rows<float>(h_M2F, y, forward_row<float>);
  } else {
    forward_rows<c10::BFloat16>(h_M2F, y, forward_row<c10::BFloat16>);
  }
  return y;
}

at::Tensor swiglu_backward(const at::Tensor& grad_MF, const at::Tensor& h_M2F) {
  check_gated_grad(grad_MF, h_M2F, "swiglu_backward");
  at::Tensor grad_h = at::empty_like(h_M2F);
  if (h_M2F.scalar_type() == at::kFloat) {
    backward_rows<float>(grad_MF, h_M2F, grad_h, backward_row<float>);
  } else {
    backward_rows<c10::BFloat16>(grad_MF, h_M2F, grad_h, backward_row<c10::BFloat16>);
  }
  return grad_h;
}

at::Tensor quick_geglu(const at::Tensor& h_M2F, double alpha, double offset, std::optional<double> clamp) {
  check_gated_rows(h_M2F, "quick_geglu");
  at::Tensor y = at::empty({h_M2F.size(0), h_M2F.size(1) / 2}, h_M2F.options());
  if (h_M2F.scalar_type() == at::kFloat) {
    const QuickGeglu p = geglu_parameters<float>(alpha, offset, clamp);
    forward_rows<float>(h_M2F, y, [p](auto... a) { geglu_forward_row<float>(a..., p); });
  } else {
    const QuickGeglu p = geglu_parameters<c10::BFloat16>(alpha, offset, clamp);
    forward_rows<c10::BFloat16>(h_M2F, y, [p](auto... a) { geglu_forward_row<c10::BFloat16>(a..., p); });
  }
  return y;
}

at::Tensor quick_geglu_backward(const at::Tensor& grad_MF, const at::Tensor& h_M2F, double alpha, double offset,
                                std::optional<double> clamp) {
  check_gated_grad(grad_MF, h_M2F, "quick_geglu_backward");
  at::Tensor grad_h = at::empty_like(h_M2F);
  if (h_M2F.scalar_type() == at::kFloat) {
    const QuickGeglu p = geglu_parameters<float>(alpha, offset, clamp);
    backward_rows<float>(grad_MF, h_M2F, grad_h, [p](auto... a) { geglu_backward_row<float>(a..., p); });
  } else {
    const QuickGeglu p = geglu_parameters<c10::BFloat16>(alpha, offset, clamp);
    backward_rows<c10::BFloat16>(grad_MF, h_M2F, grad_h,
                                 [p](auto... a) { geglu_backward_row<c10::BFloat16>(a..., p); });
  }
  return grad_h;
}

}  // namespace moezero
