// Un-permute with the weighted top-k combine, and its backward.
//
// Both run one token per iteration: the forward gathers the token's K expert rows into an
// fp32 (fp64) accumulator row, the backward reads the token's output gradient once and, for
// each k, writes the expert row's gradient and the routing-weight dot product in the same
// sweep. Inner loops over D are branch-free so the compiler vectorises them.
#include "moezero_ops.h"
#include "cpu_utils.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

namespace moezero {
namespace {

// fp32 for fp32/bf16/fp16 rows, fp64 for fp64 rows: the dtype the reference accumulates in.
template <typename scalar_t>
using acc_type = at::opmath_type<scalar_t>;

constexpr int kLanes = 32;  // independent partial sums: the dot product vectorises and hides add latency

template <typename scalar_t, typename acc_t>
inline acc_t dot(const acc_t* a, const scalar_t* b, int64_t n) {
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * static_cast<acc_t>(b[i + j]);
  }
  acc_t sum = 0;
  for (; i < n; ++i) sum += a[i] * static_cast<acc_t>(b[i]);
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

// out_D = sum_k w_K[k] * y[rows_K[k]], accumulated in acc_D (scratch of D).
template <typename scalar_t>
MOEZERO_MULTIVERSION void combine_token(const scalar_t* y, const int64_t* rows_K, const acc_type<scalar_t>* w_K,
                                        scalar_t* out_D, acc_type<scalar_t>* acc_D, int64_t K, int64_t D) {
  using acc_t = acc_type<scalar_t>;
  std::fill(acc_D, acc_D + D, acc_t(0));
  for (int64_t k = 0; k < K; ++k) {
    if (rows_K[k] < 0) continue;
    const acc_t wk = w_K ? w_K[k] : acc_t(1);
    const scalar_t* src = y + rows_K[k] * D;
    for (int64_t d = 0; d < D; ++d) acc_D[d] += wk * static_cast<acc_t>(src[d]);
  }
  for (int64_t d = 0; d < D; ++d) out_D[d] = static_cast<scalar_t>(acc_D[d]);
}

// For each kept k: grad_y[rows_K[k]] = w_K[k] * grad_D and grad_w_K[k] = <grad_D, y[rows_K[k]]>.
template <typename scalar_t>
MOEZERO_MULTIVERSION void combine_backward_token(const scalar_t* grad_D, const scalar_t* y, const int64_t* rows_K,
                                                 const acc_type<scalar_t>* w_K, scalar_t* grad_y,
                                                 acc_type<scalar_t>* grad_w_K, acc_type<scalar_t>* g_D,
                                                 int64_t K, int64_t D) {
  using acc_t = acc_type<scalar_t>;
  for (int64_t d = 0; d < D; ++d) g_D[d] = static_cast<acc_t>(grad_D[d]);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t r = rows_K[k];
    if (r < 0) {
      if (grad_w_K) grad_w_K[k] = 0;
      continue;
    }
    const acc_t wk = w_K ? w_K[k] : acc_t(1);
    scalar_t* dst = grad_y + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(wk * g_D[d]);
    if (grad_w_K) grad_w_K[k] = dot(g_D, y + r * D, D);
  }
}

template <typename scalar_t>
void combine_tokens(const scalar_t* y, const int64_t* rows, const acc_type<scalar_t>* w,
                    scalar_t* out, int64_t T, int64_t K, int64_t D) {
#pragma omp parallel num_threads(threads_for(T * K * D))
  {
    std::vector<acc_type<scalar_t>> acc(static_cast<size_t>(D));
#pragma omp for schedule(dynamic, 16)
    for (int64_t t = 0; t < T; ++t) {
      combine_token(y, rows + t * K, w ? w + t * K : nullptr, out + t * D, acc.data(), K, D);
    }
  }
}

template <typename scalar_t>
void combine_backward_tokens(const scalar_t* grad, const scalar_t* y, const int64_t* rows,
                             const acc_type<scalar_t>* w, scalar_t* grad_y, acc_type<scalar_t>* grad_w,
                             int64_t T, int64_t K, int64_t D) {
#pragma omp parallel num_threads(threads_for(T * K * D))
  {
    std::vector<acc_type<scalar_t>> g(static_cast<size_t>(D));
#pragma omp for schedule(dynamic, 16)
    for (int64_t t = 0; t < T; ++t) {
      combine_backward_token(grad + t * D, y, rows + t * K, w ? w + t * K : nullptr, grad_y,
                             grad_w ? grad_w + t * K : nullptr, g.data(), K, D);
    }
  }
}

void check_combine_args(const at::Tensor& y_ND, const at::Tensor& row_map_TK,
                        const std::optional<at::Tensor>& weights_TK) {
  TORCH_CHECK(y_ND.device().is_cpu() && row_map_TK.device().is_cpu(), "unpermute_combine: the CPU kernel got ",
              y_ND.device(), " tensors");
  TORCH_CHECK(y_ND.dim() == 2 && row_map_TK.dim() == 2, "unpermute_combine: y_ND and row_map_TK must be 2-D");
  TORCH_CHECK(row_map_TK.scalar_type() == at::kLong, "unpermute_combine: row_map_TK must be int64");
  TORCH_CHECK(!weights_TK || weights_TK->sizes() == row_map_TK.sizes(),
              "unpermute_combine: weights_TK must have row_map_TK's shape ", row_map_TK.sizes());
}

// Number of kept assignments; every row index must address one of the N rows of y.
int64_t count_kept_rows(const at::Tensor& rows, int64_t N) {
  const int64_t* r = rows.data_ptr<int64_t>();
  int64_t kept = 0;
  bool in_range = true;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    kept += r[i] >= 0;
    in_range = in_range && r[i] < N;
  }
  TORCH_CHECK(in_range, "unpermute_combine: row_map_TK addresses a row >= y_ND.size(0) (", N, ")");
  return kept;
}

// The weights in the accumulation dtype (a T x K copy, negligible next to the rows).
std::optional<at::Tensor> weights_as(const std::optional<at::Tensor>& weights_TK, at::ScalarType acc) {
  if (!weights_TK) return std::nullopt;
  return weights_TK->to(acc).contiguous();
}

}  // namespace

at::Tensor unpermute_combine(const at::Tensor& y_ND, const at::Tensor& row_map_TK,
                             const std::optional<at::Tensor>& weights_TK) {
  check_combine_args(y_ND, row_map_TK, weights_TK);
  const at::Tensor y = y_ND.contiguous(), rows = row_map_TK.contiguous();
  const int64_t T = rows.size(0), K = rows.size(1), D = y.size(1);
  count_kept_rows(rows, y.size(0));
  at::Tensor out = at::empty({T, D}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moezero_combine", [&] {
    using acc_t = acc_type<scalar_t>;
    const auto w = weights_as(weights_TK, c10::CppTypeToScalarType<acc_t>::value);
    combine_tokens(y.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(), w ? w->data_ptr<acc_t>() : nullptr,
                   out.data_ptr<scalar_t>(), T, K, D);
  });
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> unpermute_combine_backward(
    const at::Tensor& grad_TD, const at::Tensor& y_ND, const at::Tensor& row_map_TK,
    const std::optional<at::Tensor>& weights_TK) {
  check_combine_args(y_ND, row_map_TK, weights_TK);
  const at::Tensor rows = row_map_TK.contiguous(), y = y_ND.contiguous();
  const at::Tensor grad = grad_TD.to(y.scalar_type()).contiguous();
  const int64_t T = rows.size(0), K = rows.size(1), N = y.size(0), D = y.size(1);
  TORCH_CHECK(grad.sizes() == at::IntArrayRef({T, D}), "unpermute_combine_backward: grad_TD must be [", T, ", ", D, "]");
  // Every kept assignment writes its own row; rows nobody maps to must read as zero.
  const bool all_rows_written = count_kept_rows(rows, N) == N;
  at::Tensor grad_y = all_rows_written ? at::empty_like(y) : at::zeros_like(y);
  std::optional<at::Tensor> grad_w;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "moezero_combine_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    const at::ScalarType acc = c10::CppTypeToScalarType<acc_t>::value;
    const auto w = weights_as(weights_TK, acc);
    if (w) grad_w = at::empty({T, K}, y.options().dtype(acc));
    combine_backward_tokens(grad.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(),
                            w ? w->data_ptr<acc_t>() : nullptr, grad_y.data_ptr<scalar_t>(),
                            grad_w ? grad_w->data_ptr<acc_t>() : nullptr, T, K, D);
  });
  if (grad_w) grad_w = grad_w->to(weights_TK->scalar_type());
  return {grad_y, grad_w};
}

}  // namespace moezero
