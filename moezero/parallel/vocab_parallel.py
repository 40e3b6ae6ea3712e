"""The vocabulary split over a tensor-parallel group: Megatron's VocabParallelEmbedding and
vocab_parallel_cross_entropy, on moezero's (B, S) token ids and (B, S, D) activations.

Rank r holds vocabulary rows [r V/tp, (r+1) V/tp) of the embedding and, in the output layer (a column-parallel
linear without gather_output), the same slice of the logits. The loss never gathers the logits: the max, the
target's logit and the sum of exponentials are reduced over the group instead.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.parallel import comm
from moezero.parallel.tensor_marker import TensorShard, mark_tensor_parallel
from moezero.parallel.tp_regions import reduce_from_tp, reduce_scatter_to_sp

IGNORE_INDEX = -100  # F.cross_entropy's default, as ops/cross_entropy.py


def vocab_range(vocab_size: int, group: Optional[Any]) -> Tuple[int, int]:
    """The vocabulary rows [lo, hi) this rank of `group` holds."""
    size = comm.group_size(group)
    if vocab_size % size:
        raise ValueError(f"a vocabulary of {vocab_size} does not split over a tensor-parallel group of {size}")
    n = vocab_size // size
    rank = comm.group_rank(group)
    return rank * n, (rank + 1) * n


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over `group`: each rank looks up the ids in its rows (zeros for the
    others) and the partial embeddings are summed over the group — all-reduced, or under sequence_parallel
    reduce-scattered so each rank keeps its shard of `sequence_dim` (Megatron's reduce_scatter_embeddings)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Optional[Any],
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, group)
        self.shard = TensorShard((num_embeddings, embedding_dim), 0, ((self.vocab_start, self.vocab_end),))
        weight = torch.empty(num_embeddings, embedding_dim, dtype=dtype)
        nn.init.normal_(weight)  # as nn.Embedding draws it, so one rank starts as nn.Embedding does
        self.weight = nn.Parameter(self.shard.local_of(weight))
        mark_tensor_parallel(self.weight, self.shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if comm.group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.group, self.sequence_dim)
        return reduce_from_tp(partial, self.group)

    @torch.no_grad()
    def copy_from_global_(self, weight: torch.Tensor) -> "VocabParallelEmbedding":
        """Set the rank's rows from the global (num_embeddings, embedding_dim) weight."""
        self.weight.copy_(self.shard.local_of(weight))
        return self

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
            f"sequence_parallel={self.sequence_parallel}"
        )


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    group: Optional[Any],
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split over `group` along the last dim (rank r: vocabulary slice r),
    shaped as `target`; a target of -100 (ignore_index) gives loss 0 and no gradient.

    Computed in the logits' dtype, at least fp32 (bf16 logits: fp32, float64: float64, as token_cross_entropy),
    with Megatron's label smoothing: the target gets 1 - alpha, every other token alpha / (V - 1), over the
    global vocabulary V — torch's F.cross_entropy(label_smoothing=alpha V / (V - 1)).
    (megatron-core's takes V and the mean log-probability over the rank's slice only at tp > 1.)
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing {label_smoothing}: must be in [0, 1)")
    if tuple(logits_shard.shape[:-1]) != tuple(target.shape):
        raise ValueError(f"logits shaped {tuple(logits_shard.shape)} for targets shaped {tuple(target.shape)}")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, label_smoothing)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, target, group, label_smoothing):
        dtype = torch.promote_types(logits_shard.dtype, torch.float32)
        shifted = logits_shard.to(dtype, copy=True)  # becomes the softmax, kept for backward
        local_vocab = shifted.shape[-1]
        vocab = local_vocab * comm.group_size(group)
        lo = comm.group_rank(group) * local_vocab

        maxes = shifted.amax(-1)
        comm.all_reduce(maxes, group, op=dist.ReduceOp.MAX)
        shifted -= maxes.unsqueeze(-1)
        outside = (target < lo) | (target >= lo + local_vocab)  # -100 included: outside every slice
        local_target = (target - lo).masked_fill(outside, 0)
        # three sums over the vocabulary in one all-reduce: the target's logit (on the rank holding it), the
        # logits themselves (for the smoothing term's mean log-probability) and the exponentials
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        logit_sum = shifted.sum(-1) if label_smoothing else torch.zeros_like(maxes)
        sums = torch.stack([target_logit, logit_sum, shifted.exp_().sum(-1)])
        comm.all_reduce(sums, group)
        target_logit, logit_sum, exp_sum = sums
        log_exp_sum = exp_sum.log()
        loss = log_exp_sum - target_logit
        smoothing = label_smoothing * vocab / (vocab - 1) if label_smoothing else 0.0
        if smoothing:
            mean_log_prob = logit_sum / vocab - log_exp_sum
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_prob
        ignored = target == IGNORE_INDEX
        softmax = shifted.div_(exp_sum.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        ctx.smoothing, ctx.vocab, ctx.logits_dtype = smoothing, vocab, logits_shard.dtype
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax  # d loss / d logit = softmax - (1 - s) onehot - s / V, written over the saved softmax
        hit = (~outside).to(grad.dtype) * (1.0 - ctx.smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if ctx.smoothing:
            grad -= ctx.smoothing / ctx.vocab
        grad *= grad_loss.masked_fill(ignored, 0.0).to(grad.dtype).unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None
