"""The word embedding across pipeline stages: the first stage's and the last stage's copy of it, kept equal as one
weight. The last stage uses it for its output layer with tied embedding and output weights (Megatron's default
without --untie-embeddings-and-output-weights), and for the MTP depths' input with --mtp-num-layers (tied or not:
Megatron's embedding group holds the MTP stage's copy either way).

Megatron's embedding group (the first and last rank of each pipeline, `ranks.py`) carries it, and Megatron's
optimizer holds both copies (the last stage's marked shared, left out of the norm). Here the copy is held outside
the last stage's optimizer (StageModel.embedding_copy, not one of its params), so the optimizer of the first stage
alone steps the weight; each element is counted once in the gradient norm and stored once in a checkpoint without
a rule of its own:

- init: both stages key the weight by its full name, `embedding.weight` (GPTModel's), so they start equal;
- during the step's backwards: the copy's gradient of each micro-batch is added into a buffer of the exchange dtype
  (fp32 at least, as Megatron's main grads), its `.grad` cleared;
- before the optimizer's step: that sum travels to the first stage over the embedding group, and the first stage
  adds it to its embedding's gradient with one more backward pass through its optimizer, of dot(weight, sum): its
  gradient is the sum, accumulated by ZeRO's own hooks into the step's gradient (under no_sync: the step then
  averages over the data-parallel ranks, as one process's gradient of the weight used twice). The optimizer's
  gradient is not readable in place (a bf16 param's lives in fp32 buckets), hence a backward pass, not a write;
- after the step (and after a checkpoint's load): the first stage's values are broadcast to the copy.

Middle stages are outside the embedding group and do nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize


class TiedEmbedding:
    """One rank's side of the tied weight: `weight` (the first stage's embedding or the last stage's copy), the
    rank's PipelineGroups (its embedding group) and that group's first rank (global), which holds the weight the
    optimizer steps."""

    def __init__(self, weight: nn.Parameter, groups: Any, source: int, holds_optimized: bool):
        self.weight, self.groups, self.source = weight, groups, source
        self.holds_optimized = holds_optimized  # the first stage: its optimizer steps the weight
        self._summed: Optional[torch.Tensor] = None  # the copy's gradient over the step's micro-batches
        if not holds_optimized:
            weight.register_post_accumulate_grad_hook(self._accumulate)

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
        # the same on both stages (their params share a dtype)
        return torch.promote_types(self.weight.dtype, torch.float32)

    @torch.no_grad()
    def _accumulate(self, weight: torch.Tensor) -> None:
        if self._summed is None:
            self._summed = torch.zeros(weight.shape, dtype=self._exchange_dtype, device=weight.device)
        self._summed += weight.grad
        weight.grad = None

    def sum_grads(self, opt) -> None:
        """Collective over the embedding group (and, on the first stage, a backward pass through `opt`, its
        ZeroOptimizer, under no_sync): the copy's gradient joins the first stage's before the optimizer reduces."""
        summed = self._summed
        if summed is None:  # the first stage, or a copy without a gradient this step (adds zero)
            summed = torch.zeros(self.weight.shape, dtype=self._exchange_dtype, device=self.weight.device)
        self._summed = None
        dist.all_reduce(summed, group=self.group)
        if self.holds_optimized:
            with opt.no_sync(), torch.enable_grad():  # fp16: the sum carries the loss scale already
                opt.backward_of_scaled(torch.dot(self.weight.view(-1), summed.view(-1).to(self.weight.dtype)))

    @torch.no_grad()
    def refresh(self) -> None:
        """Collective over the embedding group: the copy takes the first stage's values."""
        dist.broadcast(self.weight.data, self.source, group=self.group)

    def clear_grad(self) -> None:
        self._summed = None
        if not self.holds_optimized:
            self.weight.grad = None


def tied_embedding(model, groups) -> Optional[TiedEmbedding]:
    """This rank's side of the tied weight (None: untied without MTP, a middle stage, or pp 1). `model`: a
    StageModel, `groups`: its PipelineGroups."""
    config = model.config
    copied = not config.untie_embeddings_and_output_weights or bool(config.mtp_num_layers)  # the last stage's use
    if not copied or groups.embedding is None or groups.pp_size == 1:
        return None
    if model.embedding is not None:
        return TiedEmbedding(_weight_param(model.embedding), groups, groups.embedding_ranks[0], True)
    if model.embedding_copy is not None:
        return TiedEmbedding(_weight_param(model.embedding_copy), groups, groups.embedding_ranks[0], False)
    return None


def _weight_param(embedding: nn.Embedding) -> nn.Parameter:
    """The embedding's weight Parameter, also under a parametrization (QAT's fake quantization: `.weight` is then
    the quantized value of this `original`)."""
    if parametrize.is_parametrized(embedding, "weight"):
        return embedding.parametrizations.weight.original
    return embedding.weight
