// GELU with an optional per-expert bias added first: the exact (erf) one, or the tanh approximation (Megatron's
// fused bias-GELU, torch's approximate="tanh").
//
// Forward, one pass over y (M rows of F, rows grouped by expert, counts[l] of them):
//   h = round(y + bias[l]),  a = round(gelu(h)); h is what the backward keeps (y itself without a bias).
// Exact: gelu(h) = h * Phi(h), Phi(h) = (1 + erf(h / sqrt 2)) / 2, gelu'(h) = Phi(h) + h * phi(h) with
// phi(h) = exp(-h^2 / 2) / sqrt(2 pi). erf is the Abramowitz-Stegun 7.1.26 form torch's vectorised CPU GELU uses
// (|error| < 1.5e-7), whose exp(-h^2/2) is also phi's, so the derivative costs a few multiplies more.
// Tanh: gelu(h) = h * s with s = (1 + tanh u) / 2 = sigmoid(2u), u = sqrt(2/pi) (h + 0.044715 h^3), from one
// exp(-2|u|); gelu'(h) = s + 2 h s (1 - s) du/dh.
// Backward, one pass over the gradient and h:  grad_h = round(grad_a * gelu'(h)), gelu'(h) in fp32 (torch's
// gelu_backward: one rounding; a bf16 gelu'(h) saved by the forward rounded twice, up to 1.4 ulp off), and, when
// asked, each expert's bias gradient: the column sums of its rows of grad_h, in fp32, in row order
// (deterministic). The activation memory is torch's (h).
#include "moezero_ops.h"
#include "cpu_utils.h"
#include "element_math.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace moezero {
namespace {

using namespace element;


// (gelu(h), gelu'(h)) of an exact h.
inline void gelu_and_derivative(float h, float& a, float& d) {
  constexpr float kSqrtHalf = 0.70710678118654752f;
  constexpr float kInvSqrt2Pi = 0.39894228040143268f;
  const float z = std::fabs(h) * kSqrtHalf;
  const float t = 1.0f / std::fma(0.3275911f, z, 1.0f);
  float r = std::fma(1.061405429f, t, -1.453152027f);
  r = std::fma(r, t, 1.421413741f);
  r = std::fma(r, t, -0.284496736f);
  r = std::fma(r, t, 0.254829592f);
  const float e = exp_nonpositive(-0.5f * h * h);
  const float erf_abs = 1.0f - r * t * e;
  const float cdf = 0.5f * (1.0f + std::copysign(erf_abs, h));
  a = h * cdf;
  d = std::fma(h, kInvSqrt2Pi * e, cdf);
}

// The tanh approximation's (gelu(h), gelu'(h)). e = exp(-2|u|) <= 1 keeps the exp's argument non-positive and
// s = 1 / (1 + e) or e / (1 + e) by the sign; past |2u| = 87 e is 0, so the far negative tail is exactly 0, and
// there gelu'(h) is s (the slope term would be 0 * inf once h^2 overflows), NaN for a NaN h.
inline void gelu_tanh_and_derivative(float h, float& a, float& d) {
  constexpr float kBeta = 0.79788456080286536f;   // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const float h2 = h * h;
  const float v = 2.0f * std::fabs(kBeta * h * std::fma(kKappa, h2, 1.0f));
  const float e = v < 87.0f ? exp_nonpositive(-v) : 0.0f;
  const float inv = 1.0f / (1.0f + e);
  const float s = h >= 0.0f ? inv : e * inv;
  a = h * s;
  const float tail = h == h ? s : h;
  d = e > 0.0f ? std::fma(2.0f * h * (e * inv * inv), kBeta * std::fma(3.0f * kKappa, h2, 1.0f), s) : tail;
}

// gelu(h) (Slope false) or gelu'(h) (Slope true) of an exact h, in fp32 (the other of the pair is computed and
// dropped: the compiler removes it)
template <bool Tanh, bool Slope>
inline float gelu_part(float h) {
  float a, d;
  if constexpr (Tanh) {
    gelu_tanh_and_derivative(h, a, d);
  } else {
    gelu_and_derivative(h, a, d);
  }
  return Slope ? d : a;
}

// bf16 rows go in blocks of kBlock: widen (and add the bias), compute in fp32, narrow; loops of one element type
// each vectorise better (one loop doing all three was slower); fp32 rows are faster in one loop.
constexpr int64_t kBlock = 256;

template <bool Tanh, typename T>
MOEZERO_ELEMENT_MULTIVERSION void forward_row(const T* y, const T* bias, T* a, T* h_out, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (bias != nullptr) {
      for (int64_t i = 0; i < n; ++i) {
        h_out[i] = y[i] + bias[i];
        a[i] = gelu_part<Tanh, false>(h_out[i]);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) a[i] = gelu_part<Tanh, false>(y[i]);
    }
    return;
  }
  float h[kBlock], ab[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t m = std::min(kBlock, n - begin);
    if (bias != nullptr) {
      for (int64_t i = 0; i < m; ++i) h[i] = round_to<T>(load(y, begin + i) + load(bias, begin + i));
      for (int64_t i = 0; i < m; ++i) store(h_out, begin + i, h[i]);   // exact: h is a T already
    } else {
      for (int64_t i = 0; i < m; ++i) h[i] = load(y, begin + i);
    }
    for (int64_t i = 0; i < m; ++i) ab[i] = gelu_part<Tanh, false>(h[i]);
    for (int64_t i = 0; i < m; ++i) store(a, begin + i, ab[i]);
  }
}

// grad_h of one row from its h (and its addition to the column sums when `sums` is given), in blocks: widen h,
// gelu'(h) in fp32, then one rounding of grad_a * gelu'(h).
template <bool Tanh, typename T>
MOEZERO_ELEMENT_MULTIVERSION void backward_row(const T* g, const T* h, T* grad_h, float* sums, int64_t n) {
  float db[kBlock];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t m = std::min(kBlock, n - begin);
    for (int64_t i = 0; i < m; ++i) db[i] = load(h, begin + i);
    for (int64_t i = 0; i < m; ++i) db[i] = gelu_part<Tanh, true>(db[i]);
    if (sums != nullptr) {
      for (int64_t i = 0; i < m; ++i) {
        const float v = round_to<T>(load(g, begin + i) * db[i]);
        store(grad_h, begin + i, v);   // exact: v is a T already
        sums[begin + i] += v;
      }
    } else {
      for (int64_t i = 0; i < m; ++i) store(grad_h, begin + i, load(g, begin + i) * db[i]);
    }
  }
}

// The expert of every row, from the per-expert row counts (which must add up to M).
std::vector<int64_t> row_experts(const std::vector<int64_t>& counts, int64_t rows) {
  std::vector<int64_t> expert(static_cast<size_t>(rows));
  int64_t row = 0;
  for (int64_t l = 0; l < static_cast<int64_t>(counts.size()); ++l) {
    TORCH_CHECK(counts[l] >= 0 && row + counts[l] <= rows, "bias_gelu: counts exceed the ", rows, " rows");
    for (int64_t i = 0; i < counts[l]; ++i) expert[static_cast<size_t>(row++)] = l;
  }
  TORCH_CHECK(row == rows, "bias_gelu: counts add up to ", row, " rows, the input has ", rows);
  return expert;
}

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "bias_gelu: the CPU kernel got ", name, " on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "bias_gelu: ", name, " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "bias_gelu: ", name, " must be a contiguous 2-D tensor");
}

template <bool Tanh, typename T>
void forward_rows(const at::Tensor& y, const at::Tensor* bias, const std::vector<int64_t>& expert, at::Tensor& a,
                  at::Tensor& h) {
  const int64_t rows = y.size(0), n = y.size(1);
  const T* yp = y.data_ptr<T>();
  const T* bp = bias != nullptr ? bias->data_ptr<T>() : nullptr;
  T* ap = a.data_ptr<T>();
  T* hp = bias != nullptr ? h.data_ptr<T>() : nullptr;   // without a bias h is y: nothing to write
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* b = bp != nullptr ? bp + expert[static_cast<size_t>(r)] * n : nullptr;
    forward_row<Tanh, T>(yp + r * n, b, ap + r * n, hp != nullptr ? hp + r * n : nullptr, n);
  }
}

template <bool Tanh>
void forward_any_dtype(const at::Tensor& y, const at::Tensor* bias, const std::vector<int64_t>& expert,
                       at::Tensor& a, at::Tensor& h) {
  if (y.scalar_type() == at::kFloat) {
    forward_rows<Tanh, float>(y, bias, expert, a, h);
  } else {
    forward_rows<Tanh, c10::BFloat16>(y, bias, expert, a, h);
  }
}

// Threads split the columns (each sums its columns over all rows, in row order): the result does not depend on
// the number of threads.
template <bool Tanh, typename T>
void backward_rows(const at::Tensor& g, const at::Tensor& h, const std::vector<int64_t>& counts, bool with_sums,
                   at::Tensor& grad_h, at::Tensor& sums) {
  const int64_t rows = g.size(0), n = g.size(1);
  const int threads = threads_for(rows * n);
  const int64_t per_thread = (n + threads - 1) / threads;
  const T* gp = g.data_ptr<T>();
  const T* xp = h.data_ptr<T>();
  T* hp = grad_h.data_ptr<T>();
  float* sp = with_sums ? sums.data_ptr<float>() : nullptr;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int part = 0; part < threads; ++part) {
    const int64_t begin = part * per_thread, width = std::min(n, begin + per_thread) - begin;
    if (width <= 0) continue;
    int64_t row = 0;
    for (int64_t l = 0; l < static_cast<int64_t>(counts.size()); ++l) {
      float* s = sp != nullptr ? sp + l * n + begin : nullptr;
      for (int64_t end = row + counts[l]; row < end; ++row) {
        const int64_t at = row * n + begin;
        backward_row<Tanh, T>(gp + at, xp + at, hp + at, s, width);
      }
    }
  }
}

template <bool Tanh>
void backward_any_dtype(const at::Tensor& g, const at::Tensor& h, const std::vector<int64_t>& counts, bool with_sums,
                        at::Tensor& grad_h, at::Tensor& sums) {
  if (g.scalar_type() == at::kFloat) {
    backward_rows<Tanh, float>(g, h, counts, with_sums, grad_h, sums);
  } else {
    backward_rows<Tanh, c10::BFloat16>(g, h, counts, with_sums, grad_h, sums);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> bias_gelu(const at::Tensor& y_MF, const std::optional<at::Tensor>& bias_LF,
                                             const std::vector<int64_t>& counts, bool tanh) {
  check_input(y_MF, "y_MF");
  const std::vector<int64_t> expert = row_experts(counts, y_MF.size(0));
  if (bias_LF.has_value()) {
    check_input(*bias_LF, "bias_LF");
    TORCH_CHECK(bias_LF->scalar_type() == y_MF.scalar_type(), "bias_gelu: bias_LF's dtype differs from y_MF's");
    TORCH_CHECK(bias_LF->size(0) == static_cast<int64_t>(counts.size()) && bias_LF->size(1) == y_MF.size(1),
                "bias_gelu: bias_LF must be (", counts.size(), ", ", y_MF.size(1), ")");
  }
  const at::Tensor* bias = bias_LF.has_value() ? &*bias_LF : nullptr;
  at::Tensor a = at::empty_like(y_MF), h = bias != nullptr ? at::empty_like(y_MF) : y_MF;
  if (tanh) {
    forward_any_dtype<true>(y_MF, bias, expert, a, h);
  } else {
    forward_any_dtype<false>(y_MF, bias, expert, a, h);
  }
  return {a, h};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_gelu_backward(
    const at::Tensor& grad_a_MF, const at::Tensor& h_MF, const std::vector<int64_t>& counts, bool bias_grad,
    bool tanh) {
  check_input(grad_a_MF, "grad_a_MF");
  check_input(h_MF, "h_MF");
  TORCH_CHECK(grad_a_MF.sizes() == h_MF.sizes() && grad_a_MF.scalar_type() == h_MF.scalar_type(),
              "bias_gelu_backward: grad_a_MF and h_MF differ in shape or dtype");
  row_experts(counts, grad_a_MF.size(0));   // checks the counts
  at::Tensor grad_h = at::empty_like(grad_a_MF);
  at::Tensor sums;
  if (bias_grad) {
    sums = at::zeros({static_cast<int64_t>(counts.size()), grad_a_MF.size(1)}, grad_a_MF.options().dtype(at::kFloat));
  }
  if (tanh) {
    backward_any_dtype<true>(grad_a_MF, h_MF, counts, bias_grad, grad_h, sums);
  } else {
    backward_any_dtype<false>(grad_a_MF, h_MF, counts, bias_grad, grad_h, sums);
  }
  if (!bias_grad) return {grad_h, std::nullopt};
  return {grad_h, sums};
}

}  // namespace moezero
