"""A naive per-token MoE: the oracle for the MoE layer tests."""

import torch

from moezero.moe.experts import activation


def naive_moe(x_TD, wg_ED, w1_EDF, w2_EFD, config, expert_bias=None):
    """Route and run every token through its experts one at a time (dropless)."""
    out = torch.zeros_like(x_TD)
    logits = x_TD.double() @ wg_ED.double().t() if x_TD.dtype == torch.float64 else x_TD.float() @ wg_ED.float().t()
    for t in range(x_TD.shape[0]):
        scores = torch.softmax(logits[t], -1) if config.score_function == "softmax" else torch.sigmoid(logits[t])
        select = scores + expert_bias if expert_bias is not None else scores
        ids = torch.topk(select, config.top_k).indices
        if config.score_function == "softmax" and not config.pre_softmax:
            w = torch.softmax(logits[t][ids], -1)
        else:
            w = scores[ids]
            if config.score_function == "sigmoid" and config.top_k > 1:
                w = w / (w.sum() + 1e-20)
        for weight, e in zip(w, ids.tolist()):
            h = activation(x_TD[t : t + 1] @ w1_EDF[e], config.activation)
            out[t] += (weight * (h @ w2_EFD[e])[0]).to(out.dtype)
    return out
