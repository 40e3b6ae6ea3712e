// RMSNorm over the last dimension, forward and backward, one pass over the rows each (torch's CPU RMSNorm is a
// composite: ~20 ops and as many passes with its autograd, 4-5x its LayerNorm kernel's time).
//
// Forward, per row x of n (float32 or bfloat16), in fp32 and rounded once, as torch's:
//   rstd = 1 / sqrt(mean(x^2) + eps),  y = round(x * rstd * w)   (no weight: y = round(x * rstd))
// The row's sum of squares is in fp32 in a fixed order (8 partial sums, then combined): torch's mean sums in
// another, so rstd agrees with torch's to fp32 rounding, not bit for bit.
// Backward, from the forward's rstd (fp32, one per row), in fp32 as torch's autograd of its composite:
//   gw = g * w,  grad_x = round(rstd * (gw - x * rstd^2 * mean(gw * x)))
//   grad_w = sum over rows of g * x * rstd, in fp32, in row order (threads split the columns: deterministic)
#include "moezero_ops.h"
#include "cpu_utils.h"
#include "element_math.h"
#include "row_checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace moezero {
namespace {

using element::load;
using element::store;

constexpr int kLanes = 8;   // partial sums per row: a vector's worth, combined in a fixed order

void check_weight(const std::optional<at::Tensor>& weight, const at::Tensor& x, const char* op) {
  if (!weight.has_value()) return;
  TORCH_CHECK(weight->device().is_cpu() && weight->is_contiguous() && weight->dim() == 1 &&
                  weight->size(0) == x.size(1),
              op, ": weight must be a contiguous CPU vector of ", x.size(1), " elements");
  TORCH_CHECK(weight->scalar_type() == x.scalar_type(), op, ": weight's dtype differs from x's");
}

// sum of a[i] * b[i] in fp32, in kLanes interleaved partial sums combined pairwise: one order for every call
template <typename A, typename B>
MOEZERO_ELEMENT_MULTIVERSION float dot(const A* a, const B* b, int64_t n) {
  float part[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int64_t body = n - n % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) part[k] += load(a, i + k) * load(b, i + k);
  }
  for (int64_t i = body; i < n; ++i) part[i - body] += load(a, i) * load(b, i);
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int k = 0; k < width; ++k) part[k] += part[k + width];
  }
  return part[0];
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void normalize_row(const T* x, const T* w, float rstd, T* y, int64_t n) {
  if (w != nullptr) {
    for (int64_t i = 0; i < n; ++i) store(y, i, load(x, i) * rstd * load(w, i));
  } else {
    for (int64_t i = 0; i < n; ++i) store(y, i, load(x, i) * rstd);
  }
}

template <typename T>
void forward_rows(const at::Tensor& x, const T* w, double eps, at::Tensor& y, at::Tensor& rstd) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  float* rp = rstd.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = xp + r * n;
    const float mean_square = n > 0 ? dot(row, row, n) / static_cast<float>(n) : 0.f;
    rp[r] = 1.f / std::sqrt(mean_square + epsilon);
    normalize_row<T>(row, w, rp[r], yp + r * n, n);
  }
}

// gw = g * w of one row (g itself without a weight), into fp32 scratch
template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void weighted_gradient(const T* g, const T* w, float* gw, int64_t n) {
  if (w != nullptr) {
    for (int64_t i = 0; i < n; ++i) gw[i] = load(g, i) * load(w, i);
  } else {
    for (int64_t i = 0; i < n; ++i) gw[i] = load(g, i);
  }
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void input_gradient_row(const T* x, const float* gw, float rstd, float scale, T* dx,
                                                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(dx, i, rstd * (gw[i] - load(x, i) * scale));
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void weight_gradient_row(const T* g, const T* x, float rstd, float* sums, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sums[i] += load(g, i) * (load(x, i) * rstd);
}

template <typename T>
void input_gradient(const at::Tensor& g, const at::Tensor& x, const T* w, const float* rp, at::Tensor& dx) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* gp = g.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  T* dp = dx.data_ptr<T>();
  const int threads = threads_for(rows * n);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> gw(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      weighted_gradient<T>(gp + r * n, w, gw.data(), n);
      const float rstd = rp[r];
      // mean(gw * x) * rstd^2: the part of the gradient along x (the norm's own derivative)
      const float scale = n > 0 ? dot(gw.data(), xp + r * n, n) / static_cast<float>(n) * rstd * rstd : 0.f;
      input_gradient_row<T>(xp + r * n, gw.data(), rstd, scale, dp + r * n, n);
    }
  }
}

template <typename T>
void weight_gradient(const at::Tensor& g, const at::Tensor& x, const float* rp, at::Tensor& sums) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int threads = threads_for(rows * n);
  const int64_t per_thread = (n + threads - 1) / threads;
  const T* gp = g.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  float* sp = sums.data_ptr<float>();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int part = 0; part < threads; ++part) {
    const int64_t begin = part * per_thread, width = std::min(n, begin + per_thread) - begin;
    if (width <= 0) continue;
    for (int64_t r = 0; r < rows; ++r) weight_gradient_row<T>(gp + r * n + begin, xp + r * n + begin, rp[r],
                                                               sp + begin, width);
  }
}

template <typename T>
const T* weight_data(const std::optional<at::Tensor>& weight) {
  return weight.has_value() ? weight->data_ptr<T>() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_NH, const std::optional<at::Tensor>& weight_H,
                                            double eps) {
  check_rows(x_NH, "rms_norm", "x_NH");
  check_weight(weight_H, x_NH, "rms_norm");
  at::Tensor y = at::empty_like(x_NH);
  at::Tensor rstd = at::empty({x_NH.size(0)}, x_NH.options().dtype(at::kFloat));
  if (x_NH.scalar_type() == at::kFloat) {
    forward_rows<float>(x_NH, weight_data<float>(weight_H), eps, y, rstd);
  } else {
    forward_rows<c10::BFloat16>(x_NH, weight_data<c10::BFloat16>(weight_H), eps, y, rstd);
  }
  return {y, rstd};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> rms_norm_backward(
    const at::Tensor& grad_NH, const at::Tensor& x_NH, const at::Tensor& rstd_N,
    const std::optional<at::Tensor>& weight_H, bool weight_grad) {
  check_rows(grad_NH, "rms_norm_backward", "grad_NH");
  check_rows(x_NH, "rms_norm_backward", "x_NH");
  check_weight(weight_H, x_NH, "rms_norm_backward");
  TORCH_CHECK(grad_NH.sizes() == x_NH.sizes() && grad_NH.scalar_type() == x_NH.scalar_type(),
              "rms_norm_backward: grad_NH and x_NH differ in shape or dtype");
  TORCH_CHECK(rstd_N.scalar_type() == at::kFloat && rstd_N.is_contiguous() && rstd_N.dim() == 1 &&
                  rstd_N.size(0) == x_NH.size(0),
              "rms_norm_backward: rstd_N must be the forward's fp32 vector of ", x_NH.size(0), " rows");
  at::Tensor dx = at::empty_like(x_NH);
  const float* rp = rstd_N.data_ptr<float>();
  std::optional<at::Tensor> sums;
  if (weight_grad) sums = at::zeros({x_NH.size(1)}, x_NH.options().dtype(at::kFloat));
  if (x_NH.scalar_type() == at::kFloat) {
    input_gradient<float>(grad_NH, x_NH, weight_data<float>(weight_H), rp, dx);
    if (weight_grad) weight_gradient<float>(grad_NH, x_NH, rp, *sums);
  } else {
    input_gradient<c10::BFloat16>(grad_NH, x_NH, weight_data<c10::BFloat16>(weight_H), rp, dx);
    if (weight_grad) weight_gradient<c10::BFloat16>(grad_NH, x_NH, rp, *sums);
  }
  return {dx, sums};
}

}  // namespace moezero
