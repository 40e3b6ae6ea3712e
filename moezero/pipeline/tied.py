"""Tied embedding and output weights across pipeline stages (Megatron's default without
--untie-embeddings-and-output-weights): the first stage's word embedding and the last stage's copy of it, which its
output layer uses, kept equal as one weight.

Megatron's embedding group (the first and last rank of each pipeline, `ranks.py`) carries it, and Megatron's
optimizer holds both copies (the last stage's marked shared, left out of the norm). Here the copy is held outside
the last stage's optimizer (StageModel.output_copy, not one of its params), so the optimizer of the first stage
alone steps the weight; each element is counted once in the gradient norm and stored once in a checkpoint without
a rule of its own:

- init: both stages key the weight by its full name, `embedding.weight` (GPTModel's), so they start equal;
- before the step: the copy's gradient is summed into the first stage's over the embedding group (the first
  stage's is its accumulated, not yet reduced gradient at ZeRO stages 0 and 1: the step then averages the sum over
  the data-parallel ranks, as one process's gradient of the weight used twice);
- after the step (and after a checkpoint's load): the first stage's values are broadcast to the copy, and the
  copy's gradient is dropped.

Middle stages are outside the embedding group and do nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn


class TiedEmbedding:
    """One rank's side of the tied weight: `weight` (the first stage's embedding or the last stage's copy), the
    rank's PipelineGroups (its embedding group) and that group's first rank (global), which holds the weight the
    optimizer steps."""

    def __init__(self, weight: nn.Parameter, groups: Any, source: int, holds_optimized: bool):
        self.weight, self.groups, self.source = weight, groups, source
        self.holds_optimized = holds_optimized  # the first stage: its optimizer steps the weight

    @property
    def group(self) -> Any:
        """Read at each use, never kept: after a failure the group must close (PipelineGroups.close_pp), which it
        does only once nothing refers to it, so that a neighbour waiting in the gradient sum fails at once."""
        group = self.groups.embedding
        if group is None:
            raise RuntimeError("this rank's embedding group was closed after a stage failed; the run cannot step")
        return group

    @property
    def _exchange_dtype(self) -> torch.dtype:
        # the same on both stages (their params share a dtype): a gradient of a bf16 copy is summed in fp32
        return torch.promote_types(self.weight.dtype, torch.float32)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Collective over the embedding group: the first stage's gradient becomes the sum of both (before the
        optimizer's reduction, which averages it over the data-parallel ranks)."""
        grad = self.weight.grad
        summed = (
            torch.zeros(self.weight.shape, dtype=self._exchange_dtype, device=self.weight.device)
            if grad is None
            else grad.to(self._exchange_dtype, copy=True)
        )
        dist.all_reduce(summed, group=self.group)
        if self.holds_optimized:
            if grad is None:  # the first stage always uses its embedding; kept for a skipped backward
                raise RuntimeError("the tied word embedding of the first pipeline stage got no gradient")
            grad.copy_(summed)  # in place: the optimizer's bucket view keeps holding the step's gradient

    @torch.no_grad()
    def refresh(self) -> None:
        """Collective over the embedding group: the copy takes the first stage's values; its gradient is dropped."""
        dist.broadcast(self.weight.data, self.source, group=self.group)
        if not self.holds_optimized:
            self.weight.grad = None

    def clear_grad(self) -> None:
        if not self.holds_optimized:
            self.weight.grad = None


def tied_embedding(model, groups) -> Optional[TiedEmbedding]:
    """This rank's side of the tied weight (None: untied, a middle stage, or pp 1). `model`: a StageModel,
    `groups`: its PipelineGroups."""
    if model.config.untie_embeddings_and_output_weights or groups.embedding is None or groups.pp_size == 1:
        return None
    if model.embedding is not None:
        return TiedEmbedding(model.embedding.weight, groups, groups.embedding_ranks[0], True)
    if model.output_copy is not None:
        return TiedEmbedding(model.output_copy.weight, groups, groups.embedding_ranks[0], False)
    return None
