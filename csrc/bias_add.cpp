// Each expert's bias on its rows, as one pass over the rows instead of one op per expert (GPT-OSS's and Megatron's
// biased experts add b2, and b1 where the activation is not the fused GELU).
//
// Forward:  out[r] = round(y[r] + bias[l]) for the rows r of expert l (rows grouped by expert, counts[l] of them),
// the sum in fp32 and rounded once to y's dtype: the same bits as torch's add of the two.
// Backward: each expert's bias gradient, the column sums of its rows of the output gradient, in fp32, in row order
// (deterministic: threads split the columns), as the fused bias-GELU's (gelu.cpp).
#include "moezero_ops.h"
#include "cpu_utils.h"
#include "element_math.h"
#include "row_checks.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moezero {
namespace {

using element::load;
using element::store;

// The first row of every expert (and, last, the row count), checking that the counts cover the rows exactly.
std::vector<int64_t> expert_starts(const std::vector<int64_t>& counts, int64_t rows, const char* op) {
  std::vector<int64_t> starts(counts.size() + 1, 0);
  for (size_t l = 0; l < counts.size(); ++l) {
    TORCH_CHECK(counts[l] >= 0 && starts[l] + counts[l] <= rows, op, ": counts exceed the ", rows, " rows");
    starts[l + 1] = starts[l] + counts[l];
  }
  TORCH_CHECK(starts.back() == rows, op, ": counts add up to ", starts.back(), " rows, the input has ", rows);
  return starts;
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void add_row(const T* y, const T* bias, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store(out, i, load(y, i) + load(bias, i));
}

template <typename T>
MOEZERO_ELEMENT_MULTIVERSION void sum_row(const T* g, float* sums, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sums[i] += load(g, i);
}

template <typename T>
void add_rows(const at::Tensor& y, const at::Tensor& bias, const std::vector<int64_t>& starts, at::Tensor& out) {
  const int64_t rows = y.size(0), n = y.size(1);
  const T* yp = y.data_ptr<T>();
  const T* bp = bias.data_ptr<T>();
  T* op = out.data_ptr<T>();
#pragma omp parallel for num_threads(threads_for(rows * n)) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t l = std::upper_bound(starts.begin(), starts.end(), r) - starts.begin() - 1;
    add_row<T>(yp + r * n, bp + l * n, op + r * n, n);
  }
}

template <typename T>
void sum_rows(const at::Tensor& g, const std::vector<int64_t>& starts, at::Tensor& sums) {
  const int64_t rows = g.size(0), n = g.size(1), experts = static_cast<int64_t>(starts.size()) - 1;
  const int threads = threads_for(rows * n);
  const int64_t per_thread = (n + threads - 1) / threads;
  const T* gp = g.data_ptr<T>();
  float* sp = sums.data_ptr<float>();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int part = 0; part < threads; ++part) {
    const int64_t begin = part * per_thread, width = std::min(n, begin + per_thread) - begin;
    if (width <= 0) continue;
    for (int64_t l = 0; l < experts; ++l) {
      for (int64_t r = starts[l]; r < starts[l + 1]; ++r) sum_row<T>(gp + r * n + begin, sp + l * n + begin, width);
    }
  }
}

}  // namespace

at::Tensor grouped_bias_add(const at::Tensor& y_MF, const at::Tensor& bias_LF, const std::vector<int64_t>& counts) {
  check_rows(y_MF, "grouped_bias_add", "y_MF");
  check_rows(bias_LF, "grouped_bias_add", "bias_LF");
  TORCH_CHECK(bias_LF.scalar_type() == y_MF.scalar_type(), "grouped_bias_add: bias_LF's dtype differs from y_MF's");
  TORCH_CHECK(bias_LF.size(0) == static_cast<int64_t>(counts.size()) && bias_LF.size(1) == y_MF.size(1),
              "grouped_bias_add: bias_LF must be (", counts.size(), ", ", y_MF.size(1), ")");
  const std::vector<int64_t> starts = expert_starts(counts, y_MF.size(0), "grouped_bias_add");
  at::Tensor out = at::empty_like(y_MF);
  if (y_MF.scalar_type() == at::kFloat) {
    add_rows<float>(y_MF, bias_LF, starts, out);
  } else {
    add_rows<c10::BFloat16>(y_MF, bias_LF, starts, out);
  }
  return out;
}

at::Tensor grouped_bias_grad(const at::Tensor& grad_MF, const std::vector<int64_t>& counts) {
  check_rows(grad_MF, "grouped_bias_grad", "grad_MF");
  const std::vector<int64_t> starts = expert_starts(counts, grad_MF.size(0), "grouped_bias_grad");
  at::Tensor sums = at::zeros({static_cast<int64_t>(counts.size()), grad_MF.size(1)},
                              grad_MF.options().dtype(at::kFloat));
  if (grad_MF.scalar_type() == at::kFloat) {
    sum_rows<float>(grad_MF, starts, sums);
  } else {
    sum_rows<c10::BFloat16>(grad_MF, starts, sums);
  }
  return sums;
}

}  // namespace moezero
