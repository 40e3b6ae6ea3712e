// Token cross-entropy over the vocabulary, fused (Megatron's --cross-entropy-loss-fusion): one pass to a row's
// log-sum-exp and loss, one pass to its gradient, in fp32 whatever the logits' dtype, without the fp32 copy of the
// logits, their log-softmax and the one-hot gradient the unfused path writes and reads back.
//
// Forward, per row i of logits x (N rows of V): m_i = max_j x_ij, l_i = log(sum_j exp(x_ij - m_i)),
//   loss_i = (m_i - x_i,label_i) + l_i; a row whose label is `ignore_index` has loss 0. m and l are kept apart
//   (the row's stats), never summed into one fp32 log-sum-exp: that rounding would grow with the logits' size
//   and cancel in lse - x (5e-4 off at logits near 1e4, the loss 0 at 3e38), where torch's error stays flat.
// Backward: grad_ij = g_i * (exp((x_ij - m_i) - l_i) - [j == label_i]), rounded to x's dtype; 0 on an ignored row.
// The exp is element::exp_nonpositive (its arguments are <= 0 here): within a few ulp of torch's, so the loss
// agrees with log_softmax + nll_loss in fp32 to ~1e-6 relative, not bitwise.
#include "moezero_ops.h"
#include "cpu_utils.h"
#include "element_math.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace moezero {
namespace {

using namespace element;

// Reductions run in kLanes independent lanes (so that they vectorise without reassociating a sum) and the exp sum
// in blocks of kBlock elements whose fp32 lane sums are added in fp64: accurate to ~1 ulp at any vocabulary size.
constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 512;

// The row's max, and whether all its elements are finite (a sum of x * 0, which NaN or inf makes NaN): a
// NaN-propagating max does not vectorise, so a row that is not finite takes the exact scalar path instead.
MOEZERO_ELEMENT_MULTIVERSION float row_max(const float* x, int64_t n, bool& finite) {
  float lanes[kLanes], probe[kLanes] = {};
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = load(x, j + l);
      lanes[l] = v > lanes[l] ? v : lanes[l];
      probe[l] += v * 0.0f;
    }
  }
  float m = -std::numeric_limits<float>::infinity(), p = 0.0f;
  for (; j < n; ++j) {
    const float v = load(x, j);
    m = v > m ? v : m;
    p += v * 0.0f;
  }
  for (int64_t l = 0; l < kLanes; ++l) {
    m = lanes[l] > m ? lanes[l] : m;
    p += probe[l];
  }
  finite = p == 0.0f;
  return m;
}

// sum_j exp(x_j - m) over a block, m >= every x_j.
MOEZERO_ELEMENT_MULTIVERSION float block_exp_sum(const float* x, int64_t n, float m) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += exp_nonpositive(load(x, j + l) - m);
  }
  float s = 0.0f;
  for (; j < n; ++j) s += exp_nonpositive(load(x, j) - m);
  for (int64_t l = 0; l < kLanes; ++l) s += lanes[l];
  return s;
}

// x[begin, end) as floats: x itself for fp32; bf16 widened into `buffer` (a loop of one element type each
// vectorises better than widening inside the reductions).
template <typename T>
MOEZERO_ELEMENT_MULTIVERSION const float* widened(const T* x, int64_t begin, int64_t end, float* buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return x + begin;
  } else {
    for (int64_t j = begin; j < end; ++j) buffer[j - begin] = load(x, j);
    return buffer;
  }
}

// A row's max m and l = log(sum_j exp(x_j - m)); a row holding NaN or +inf gives a NaN l (so a NaN loss and
// gradient, as torch's), one of -inf only as well.
struct RowStats {
  float max;
  float log_sum;
};
static_assert(sizeof(RowStats) == 2 * sizeof(float), "RowStats is read as a (N, 2) float32 tensor");

template <typename T>
RowStats row_stats(const T* x, int64_t n) {
  float buffer[kBlock];
  float m = -std::numeric_limits<float>::infinity();
  bool finite = true;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = std::min(n, begin + kBlock);
    bool block_finite = true;
    const float block_max = row_max(widened(x, begin, end, buffer), end - begin, block_finite);
    m = block_max > m ? block_max : m;
    finite = finite && block_finite;
  }
  if (!finite) {
    float exact = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      const float v = load(x, j);
      exact = (v > exact || v != v) ? v : exact;
    }
    double s = 0.0;
    for (int64_t j = 0; j < n; ++j) s += std::exp(static_cast<double>(load(x, j)) - exact);
    return {exact, static_cast<float>(std::log(s))};
  }
  double s = 0.0;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = std::min(n, begin + kBlock);
    s += block_exp_sum(widened(x, begin, end, buffer), end - begin, m);
  }
  return {m, static_cast<float>(std::log(s))};
}

// p_j = exp((x_j - m) - l); its argument is <= 0 in a finite row, where m is the max and l >= 0.
inline float probability(float x, RowStats r) {
  const float shifted = (x - r.max) - r.log_sum;
  return std::isfinite(r.max) && std::isfinite(r.log_sum) ? exp_nonpositive(shifted) : std::exp(shifted);
}

// g * softmax of one row (its label's column is fixed by the caller); a row whose stats are not finite goes
// through std::exp so that its NaN or inf reaches the gradient, as torch's does.
template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void row_gradient(const T* x, int64_t n, RowStats r, float g, T* out) {
  if (!std::isfinite(r.max) || !std::isfinite(r.log_sum)) {
    for (int64_t j = 0; j < n; ++j) store(out, j, g * std::exp((load(x, j) - r.max) - r.log_sum));
    return;
  }
  for (int64_t j = 0; j < n; ++j) store(out, j, g * exp_nonpositive((load(x, j) - r.max) - r.log_sum));
}

void check_inputs(const at::Tensor& logits, const at::Tensor& labels, const char* op) {
  TORCH_CHECK(logits.device().is_cpu(), op, ": the CPU kernel got logits on ", logits.device());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              op, ": logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), op, ": logits must be a contiguous 2-D tensor");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.dim() == 1 && labels.is_contiguous() &&
              labels.size(0) == logits.size(0), op, ": labels must be a contiguous int64 vector of ",
              logits.size(0), " (one per row)");
}

template <typename T>
void forward_rows(const at::Tensor& logits, const int64_t* labels, int64_t ignore_index, float* losses,
                  RowStats* stats) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* xp = logits.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const T* x = xp + i * n;
    stats[i] = row_stats(x, n);
    losses[i] = labels[i] == ignore_index ? 0.0f : (stats[i].max - load(x, labels[i])) + stats[i].log_sum;
  }
}

template <typename T>
void backward_rows(const at::Tensor& logits, const int64_t* labels, int64_t ignore_index, const float* grad,
                   const RowStats* stats, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* xp = logits.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    const float g = labels[i] == ignore_index ? 0.0f : grad[i];
    row_gradient<T>(xp + i * n, n, stats[i], g, op + i * n);
    if (labels[i] != ignore_index) {   // the label's column: g * (p - 1), from the fp32 p
      store(op + i * n, labels[i], g * probability(load(xp + i * n, labels[i]), stats[i]) - g);
    }
  }
}

void check_labels(const int64_t* labels, int64_t rows, int64_t vocab, int64_t ignore_index) {
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(labels[i] == ignore_index || (labels[i] >= 0 && labels[i] < vocab), "cross_entropy: label ",
                labels[i], " of row ", i, " is outside the vocabulary [0, ", vocab, ")");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor& logits_NV, const at::Tensor& labels_N,
                                                 int64_t ignore_index) {
  check_inputs(logits_NV, labels_N, "cross_entropy");
  const int64_t* labels = labels_N.data_ptr<int64_t>();
  check_labels(labels, logits_NV.size(0), logits_NV.size(1), ignore_index);
  at::Tensor losses = at::empty({logits_NV.size(0)}, logits_NV.options().dtype(at::kFloat));
  at::Tensor stats = at::empty({logits_NV.size(0), 2}, logits_NV.options().dtype(at::kFloat));
  RowStats* sp = reinterpret_cast<RowStats*>(stats.data_ptr<float>());
  if (logits_NV.scalar_type() == at::kFloat) {
    forward_rows<float>(logits_NV, labels, ignore_index, losses.data_ptr<float>(), sp);
  } else {
    forward_rows<c10::BFloat16>(logits_NV, labels, ignore_index, losses.data_ptr<float>(), sp);
  }
  return {losses, stats};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad_N, const at::Tensor& logits_NV, const at::Tensor& labels_N,
                                  const at::Tensor& stats_N2, int64_t ignore_index) {
  check_inputs(logits_NV, labels_N, "cross_entropy_backward");
  const int64_t rows = logits_NV.size(0);
  TORCH_CHECK(grad_N.scalar_type() == at::kFloat && grad_N.dim() == 1 && grad_N.is_contiguous() &&
              grad_N.size(0) == rows, "cross_entropy_backward: grad_N must be a contiguous float32 vector of ", rows);
  TORCH_CHECK(stats_N2.scalar_type() == at::kFloat && stats_N2.dim() == 2 && stats_N2.is_contiguous() &&
              stats_N2.size(0) == rows && stats_N2.size(1) == 2, "cross_entropy_backward: stats_N2 must be the "
              "forward's contiguous float32 (", rows, ", 2) row stats");
  const RowStats* sp = reinterpret_cast<const RowStats*>(stats_N2.data_ptr<float>());
  const int64_t* labels = labels_N.data_ptr<int64_t>();
  check_labels(labels, logits_NV.size(0), logits_NV.size(1), ignore_index);
  at::Tensor out = at::empty_like(logits_NV);
  if (logits_NV.scalar_type() == at::kFloat) {
    backward_rows<float>(logits_NV, labels, ignore_index, grad_N.data_ptr<float>(), sp, out);
  } else {
    backward_rows<c10::BFloat16>(logits_NV, labels, ignore_index, grad_N.data_ptr<float>(), sp, out);
  }
  return out;
}

}  // namespace moezero
