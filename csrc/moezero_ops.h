// Signatures of the moezero CPU kernels (one family per .cpp file), bound in bindings.cpp.
//
// Shape letters: T tokens, K top-k, E experts, D hidden, N kept (token, expert) assignments.
// The ordering contract is the one of moezero/ops/reference.py: permuted rows are sorted by
// expert and, within an expert, by flat assignment index t * K + k; row_map_TK is -1 for a
// dropped assignment (negative expert id).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace moezero {

// permute.cpp: stable counting sort of the assignments by expert, then one row copy each.
// Returns (x_ND, counts_E int64, row_map_TK int64).
std::tuple<at::Tensor, at::Tensor, at::Tensor> permute(
    const at::Tensor& x_TD, const at::Tensor& topk_ids_TK, int64_t num_experts);

// combine.cpp: out[t] = sum_k w[t, k] * y[row_map[t, k]], fp32 (fp64) accumulation.
at::Tensor unpermute_combine(
    const at::Tensor& y_ND, const at::Tensor& row_map_TK, const std::optional<at::Tensor>& weights_TK);

// combine.cpp: (grad_y_ND, grad_weights_TK or None) of unpermute_combine.
std::tuple<at::Tensor, std::optional<at::Tensor>> unpermute_combine_backward(
    const at::Tensor& grad_TD, const at::Tensor& y_ND, const at::Tensor& row_map_TK,
    const std::optional<at::Tensor>& weights_TK);

// flatten.cpp: flat[o_i : o_i + n_i] (+)= scale * tensors[i], cast to flat's dtype.
void flatten_into(at::Tensor flat, const std::vector<at::Tensor>& tensors,
                  const std::vector<int64_t>& offsets, double scale, bool accumulate);

// sum_of_squares.cpp: sum_i ||t_i||^2 as a 0-dim fp32 tensor (fp64 when any input is fp64).
at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors);

// gelu.cpp: (gelu(h), h) of h = y + bias[expert of the row] (no bias: h is y itself), float32 / bfloat16; the
// exact GELU, or its tanh approximation when `tanh`.
std::tuple<at::Tensor, at::Tensor> bias_gelu(const at::Tensor& y_MF, const std::optional<at::Tensor>& bias_LF,
                                             const std::vector<int64_t>& counts, bool tanh);

// gelu.cpp: (grad_h = grad_a * gelu'(h), each expert's bias gradient in fp32 when bias_grad, else None).
std::tuple<at::Tensor, std::optional<at::Tensor>> bias_gelu_backward(
    const at::Tensor& grad_a_MF, const at::Tensor& h_MF, const std::vector<int64_t>& counts, bool bias_grad,
    bool tanh = false);

// bias_add.cpp: y + bias[expert of the row], float32 / bfloat16 (y's and the bias's dtype alike).
at::Tensor grouped_bias_add(const at::Tensor& y_MF, const at::Tensor& bias_LF, const std::vector<int64_t>& counts);

// bias_add.cpp: each expert's bias gradient, the column sums of its rows of grad_MF, in fp32 (L, F).
at::Tensor grouped_bias_grad(const at::Tensor& grad_MF, const std::vector<int64_t>& counts);

// rms_norm.cpp: (y_NH, rstd_N fp32) of RMSNorm over the rows of x_NH, float32 / bfloat16, optional weight_H.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_NH, const std::optional<at::Tensor>& weight_H,
                                            double eps);

// rms_norm.cpp: (grad_x_NH, grad_weight_H in fp32 when weight_grad, else None) from the forward's rstd_N.
std::tuple<at::Tensor, std::optional<at::Tensor>> rms_norm_backward(
    const at::Tensor& grad_NH, const at::Tensor& x_NH, const at::Tensor& rstd_N,
    const std::optional<at::Tensor>& weight_H, bool weight_grad);

// swiglu.cpp: silu(gate) * up of rows [gate | up] (M, 2F) -> (M, F), float32 / bfloat16.
at::Tensor swiglu(const at::Tensor& h_M2F);

// swiglu.cpp: the gradient of the rows [gate | up] (M, 2F) from grad_MF.
at::Tensor swiglu_backward(const at::Tensor& grad_MF, const at::Tensor& h_M2F);

// swiglu.cpp: GPT-OSS's quick GEGLU of rows [gate | up] (M, 2F) -> (M, F): min(gate, c) sigmoid(alpha min(gate, c))
// (clamp(up, -c, c) + offset), rounded where torch's ops round; no clamp where clamp is None.
at::Tensor quick_geglu(const at::Tensor& h_M2F, double alpha, double offset, std::optional<double> clamp);

// swiglu.cpp: the gradient of the rows [gate | up] of quick_geglu from grad_MF.
at::Tensor quick_geglu_backward(const at::Tensor& grad_MF, const at::Tensor& h_M2F, double alpha, double offset,
                                std::optional<double> clamp);

// cross_entropy.cpp: (losses_N, stats_N2), both fp32, of float32 / bfloat16 logits_NV and int64 labels_N: each
// row's loss (0 on a row labelled ignore_index) and its stats (max m, log sum_j exp(x_j - m)).
std::tuple<at::Tensor, at::Tensor> cross_entropy(const at::Tensor& logits_NV, const at::Tensor& labels_N,
                                                 int64_t ignore_index);

// cross_entropy.cpp: grad_NV = grad_N * (softmax(logits) - one_hot(labels)) in logits_NV's dtype (0 on an ignored
// row), from the forward's stats_N2.
at::Tensor cross_entropy_backward(const at::Tensor& grad_N, const at::Tensor& logits_NV, const at::Tensor& labels_N,
                                  const at::Tensor& stats_N2, int64_t ignore_index);

}  // namespace moezero
