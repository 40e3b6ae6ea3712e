"""Pure-PyTorch kernels: the fallback path and the oracle every compiled kernel is tested against.

Shape letters: T tokens, K top-k, E experts, D hidden, N kept (token, expert) assignments.

Ordering contract shared with the compiled kernels: permuted rows are sorted by expert id,
and within one expert by flat assignment index t * K + k (a stable counting sort).
`row_map_TK[t, k]` is the permuted row of assignment (t, k), or -1 when it was dropped
(topk_ids_TK[t, k] == -1).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def permute(
    x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-sorted copy of the routed tokens.

    Returns (x_ND, counts_E int64, row_map_TK int64).
    """
    T, K = topk_ids_TK.shape
    ids = topk_ids_TK.reshape(-1).to(torch.int64)
    kept = ids >= 0
    counts_E = torch.bincount(ids[kept], minlength=num_experts)
    # dropped assignments sort after every expert, then are cut off
    sort_key = torch.where(kept, ids, torch.full_like(ids, num_experts))
    order_N = torch.argsort(sort_key, stable=True)[: int(counts_E.sum())]
    row_map = torch.full((T * K,), -1, dtype=torch.int64, device=ids.device)
    row_map[order_N] = torch.arange(order_N.numel(), device=ids.device)
    x_ND = x_TD.index_select(0, torch.div(order_N, K, rounding_mode="floor"))
    return x_ND, counts_E, row_map.view(T, K)


def unpermute_combine(y_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[row_map[t, k]] over kept k (w = 1 when weights is None).

    Accumulates in fp32 (fp64 for fp64 inputs) and returns y's dtype.
    """
    T, K = row_map_TK.shape
    acc_dtype = torch.promote_types(y_ND.dtype, torch.float32)
    kept = row_map_TK >= 0
    rows = torch.where(kept, row_map_TK, torch.zeros_like(row_map_TK)).reshape(-1)
    w = kept.to(acc_dtype) if weights_TK is None else torch.where(kept, weights_TK.to(acc_dtype), 0.0)
    # no rows at all (T = 0, or every assignment dropped): index_select cannot address y
    gathered = (
        y_ND.index_select(0, rows).to(acc_dtype).view(T, K, -1)
        if T * K and y_ND.shape[0]
        else y_ND.new_zeros(T, K, y_ND.shape[1], dtype=acc_dtype)
    )
    # a dropped slot reads row 0: zero the row itself (0 * an inf or NaN row 0 would be NaN), as the kernel skips it
    gathered = torch.where(kept[:, :, None], gathered, 0.0)
    return torch.einsum("tkd,tk->td", gathered, w).to(y_ND.dtype)


def unpermute_combine_backward(
    grad_TD: torch.Tensor, y_ND: torch.Tensor, row_map_TK: torch.Tensor, weights_TK: torch.Tensor | None
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of unpermute_combine: (grad_y_ND in y's dtype, grad_weights_TK in weights' dtype or None)."""
    T, K = row_map_TK.shape
    acc_dtype = torch.promote_types(y_ND.dtype, torch.float32)
    kept = row_map_TK.reshape(-1) >= 0
    rows = row_map_TK.reshape(-1)[kept]
    tokens = torch.arange(T * K, device=row_map_TK.device)[kept] // max(K, 1)
    g = grad_TD.to(acc_dtype).index_select(0, tokens)
    w = None if weights_TK is None else weights_TK.reshape(-1)[kept].to(acc_dtype)
    grad_y = torch.zeros(y_ND.shape, dtype=acc_dtype, device=y_ND.device)
    grad_y.index_copy_(0, rows, g if w is None else g * w[:, None])
    grad_w = None
    if weights_TK is not None:
        dots = (y_ND.index_select(0, rows).to(acc_dtype) * g).sum(-1)
        grad_w = torch.zeros(T * K, dtype=acc_dtype, device=y_ND.device)
        grad_w[kept] = dots
        grad_w = grad_w.view(T, K).to(weights_TK.dtype)
    return grad_y.to(y_ND.dtype), grad_w


def flatten_into(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    scale: float = 1.0,
    accumulate: bool = False,
) -> None:
    """flat[o_i : o_i + n_i] (+)= scale * tensors[i].flatten(), cast to flat's dtype."""
    views: List[torch.Tensor] = [flat[o : o + t.numel()] for t, o in zip(tensors, offsets)]
    sources = [t.reshape(-1) for t in tensors]
    if not views:
        return
    if accumulate:
        if scale == 1.0:
            torch._foreach_add_(views, [s.to(flat.dtype) for s in sources])
        else:
            torch._foreach_add_(views, [s.to(flat.dtype) for s in sources], alpha=scale)
    else:
        torch._foreach_copy_(views, sources)
        if scale != 1.0:
            torch._foreach_mul_(views, scale)


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_i ||t_i||^2 as one fp32 scalar (fp64 when any input is fp64)."""
    acc_dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        return torch.zeros((), dtype=acc_dtype)
    norms = torch._foreach_norm([t.to(acc_dtype) if t.dtype != acc_dtype else t for t in nonempty])
    return torch.stack(norms).square().sum()


def _expert_rows(rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Each row's block of `rows` ((L, F) -> (M, F)) for row blocks of counts[l] rows."""
    return torch.repeat_interleave(rows, torch.tensor(list(counts), device=rows.device), dim=0, output_size=sum(counts))


def _gelu_slope(wide: torch.Tensor, tanh: bool) -> torch.Tensor:
    """gelu'(h) in float64 (exact, or of the tanh approximation)."""
    if tanh:
        beta, kappa = (2.0 / torch.pi) ** 0.5, 0.044715
        t = torch.tanh(beta * (wide + kappa * wide**3))
        return 0.5 * (1.0 + t) + 0.5 * wide * (1.0 - t * t) * beta * (1.0 + 3.0 * kappa * wide * wide)
    cdf = 0.5 * (1.0 + torch.erf(wide * 0.5**0.5))
    return cdf + wide * torch.exp(-0.5 * wide * wide) * (2.0 * torch.pi) ** -0.5


def bias_gelu(
    y_MF: torch.Tensor, bias_LF: torch.Tensor | None, counts: Sequence[int], tanh: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(gelu(h) rounded to y's dtype, h) of h = y + the bias of each row's expert (rounded to y's dtype; y itself
    without a bias); rows are grouped by expert, counts[l] of them. gelu is the exact (erf) one, or its tanh
    approximation."""
    h = y_MF if bias_LF is None else y_MF + _expert_rows(bias_LF, counts)
    wide = h.double()
    if tanh:
        beta, kappa = (2.0 / torch.pi) ** 0.5, 0.044715
        return (0.5 * wide * (1.0 + torch.tanh(beta * (wide + kappa * wide**3)))).to(y_MF.dtype), h
    return (wide * 0.5 * (1.0 + torch.erf(wide * 0.5**0.5))).to(y_MF.dtype), h


def bias_gelu_backward(
    grad_a_MF: torch.Tensor, h_MF: torch.Tensor, counts: Sequence[int], bias_grad: bool, tanh: bool = False
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_h = grad_a * gelu'(h), gelu'(h) in float64, rounded once to their dtype; each expert's bias gradient
    (its rows' column sums of grad_h) in fp32, or None when not bias_grad)."""
    grad_h = (grad_a_MF.double() * _gelu_slope(h_MF.double(), tanh)).to(grad_a_MF.dtype)
    if not bias_grad:
        return grad_h, None
    sums = grad_h.new_zeros(len(counts), grad_h.shape[1], dtype=torch.float32)
    for l, block in enumerate(grad_h.split(list(counts))):
        sums[l] = block.float().sum(0)
    return grad_h, sums


def grouped_bias_add(y_MF: torch.Tensor, bias_LF: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """y + the bias of each row's expert (rows grouped by expert, counts[l] of them), in y's dtype."""
    return y_MF + _expert_rows(bias_LF, counts)


def grouped_bias_grad(grad_MF: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Each expert's bias gradient: the column sums of its rows of grad_MF, in row order, in fp32 (L, F; fp64 for
    fp64 rows). segment_reduce sums each column of each segment in row order (on CUDA a thread each, no atomics)."""
    lengths = torch.tensor(list(counts), dtype=torch.int64, device=grad_MF.device)
    wide = grad_MF.to(torch.promote_types(grad_MF.dtype, torch.float32))
    return torch.segment_reduce(wide, "sum", lengths=lengths, axis=0)


def rms_norm(x_NH: torch.Tensor, weight_H: torch.Tensor | None, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd fp32): rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w, in float64, rounded once."""
    wide = x_NH.double()
    rstd = torch.rsqrt(wide.square().mean(-1) + eps)
    y = wide * rstd[:, None]
    return (y if weight_H is None else y * weight_H.double()).to(x_NH.dtype), rstd.float()


def rms_norm_backward(
    grad_NH: torch.Tensor, x_NH: torch.Tensor, rstd_N: torch.Tensor, weight_H: torch.Tensor | None, weight_grad: bool
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x = rstd (gw - x rstd^2 mean(gw x)) with gw = g w, the weight's gradient sum(g x rstd) in fp32 or
    None), in float64 before the last rounding."""
    g, x, rstd = grad_NH.double(), x_NH.double(), rstd_N.double()[:, None]
    gw = g if weight_H is None else g * weight_H.double()
    grad_x = (rstd * (gw - x * rstd * rstd * (gw * x).mean(-1, keepdim=True))).to(x_NH.dtype)
    return grad_x, (g * x * rstd).sum(0).float() if weight_grad else None


def swiglu(h_M2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up], silu's output rounded to the rows' dtype before the product."""
    gate, up = h_M2F.double().chunk(2, dim=-1)
    s = (gate * torch.sigmoid(gate)).to(h_M2F.dtype).double()
    return (s * up).to(h_M2F.dtype)


def swiglu_backward(grad_MF: torch.Tensor, h_M2F: torch.Tensor) -> torch.Tensor:
    """[grad_gate | grad_up]: grad_up = g s, grad_s = g up (each rounded), and
    grad_gate = grad_s sig (1 + gate (1 - sig))."""
    dtype = h_M2F.dtype
    gate, up = h_M2F.double().chunk(2, dim=-1)
    g, sig = grad_MF.double(), torch.sigmoid(gate)
    s = (gate * sig).to(dtype).double()
    grad_s = (g * up).to(dtype).double()
    return torch.cat([(grad_s * sig * (1 + gate * (1 - sig))).to(dtype), (g * s).to(dtype)], dim=-1)


def _quick_geglu_parameters(dtype: torch.dtype, alpha: float, offset: float, clamp: float | None):
    """(alpha, offset, clamp) as torch's ops meet them: alpha * gate multiplies by alpha as a float32, clamp and
    + offset round their bound and offset to the rows' dtype first."""
    as_rows = lambda v: torch.tensor(v, dtype=torch.float32).to(dtype).item()
    return torch.tensor(alpha, dtype=torch.float32).item(), as_rows(offset), None if clamp is None else as_rows(clamp)


def _quick_geglu_chain(h_M2F: torch.Tensor, alpha: float, offset: float, clamp: float | None):
    """(g, u, s, a, u1) of quick_geglu in float64, each rounded to the rows' dtype where torch's ops round."""
    rounded = lambda t: t.to(h_M2F.dtype).double()
    g, u = h_M2F.double().chunk(2, dim=-1)
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    s = rounded(torch.sigmoid(rounded(g * alpha)))
    return g, u, s, rounded(g * s), rounded(u + offset) if offset else u


def quick_geglu(h_M2F: torch.Tensor, alpha: float, offset: float, clamp: float | None) -> torch.Tensor:
    """GPT-OSS's quick GEGLU of rows [gate | up]: a = round(g round(sigmoid(round(alpha g)))), y = a round(u + o)
    with g = min(gate, c), u = clamp(up, -c, c); float64 between the roundings of torch's chain of ops."""
    _, _, _, a, u1 = _quick_geglu_chain(h_M2F, *_quick_geglu_parameters(h_M2F.dtype, alpha, offset, clamp))
    return (a * u1).to(h_M2F.dtype)


def quick_geglu_backward(
    grad_MF: torch.Tensor, h_M2F: torch.Tensor, alpha: float, offset: float, clamp: float | None
) -> torch.Tensor:
    """[grad_gate | grad_up] as autograd runs quick_geglu's chain: grad_a = dy u1, grad_u = dy a, grad_gate =
    grad_a s + (grad_a g (1 - s) s) alpha, each product rounded; 0 where a clamp held the input."""
    rounded = lambda t: t.to(h_M2F.dtype).double()
    alpha, offset, clamp = _quick_geglu_parameters(h_M2F.dtype, alpha, offset, clamp)
    g, u, s, a, u1 = _quick_geglu_chain(h_M2F, alpha, offset, clamp)
    dy = grad_MF.double()
    grad_a = rounded(dy * u1)
    grad_t = rounded(rounded(grad_a * g) * (1 - s) * s)
    grad_gate, grad_up = rounded(rounded(grad_a * s) + rounded(grad_t * alpha)), rounded(dy * a)
    if clamp is not None:
        gate, up = h_M2F.double().chunk(2, dim=-1)
        grad_gate = torch.where(gate <= clamp, grad_gate, 0.0)
        grad_up = torch.where((up >= -clamp) & (up <= clamp), grad_up, 0.0)
    return torch.cat([grad_gate, grad_up], dim=-1).to(h_M2F.dtype)


def cross_entropy(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, ignore_index: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(losses_N, stats_N2), fp32, from the logits widened to fp32: each row's stats are its max m and
    l = log sum_j exp(x_j - m), kept apart (their fp32 sum would lose digits at large logits); the loss is
    (m - x_label) + l, 0 where the label is ignore_index."""
    wide = logits_NV.float()
    m = wide.amax(dim=-1) if wide.shape[-1] else wide.new_full(wide.shape[:-1], float("-inf"))
    log_sum = torch.exp(wide - m[:, None]).sum(dim=-1).log()
    kept = labels_N != ignore_index
    picked = wide.gather(1, torch.where(kept, labels_N, 0)[:, None])[:, 0]
    return torch.where(kept, (m - picked) + log_sum, 0.0), torch.stack([m, log_sum], dim=1)


def cross_entropy_backward(
    grad_N: torch.Tensor, logits_NV: torch.Tensor, labels_N: torch.Tensor, stats_N2: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """grad_N * (softmax - one_hot(labels)) in fp32, rounded to the logits' dtype (0 on an ignored row)."""
    kept = labels_N != ignore_index
    grad = torch.where(kept, grad_N, 0.0)[:, None]
    out = torch.exp((logits_NV.float() - stats_N2[:, :1]) - stats_N2[:, 1:]) * grad
    out[kept, labels_N[kept]] -= grad[kept, 0]
    return out.to(logits_NV.dtype)
