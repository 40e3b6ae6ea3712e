"""What torch.distributed.pipelining's PipelineStage wraps: one of a rank's stages (a chunk) of its StageModel, and
that stage's static input/output metadata.

The chunk holds the rank's StageModel without registering it (the rank module owns the params; ZeroOptimizer is
built on it, and its forward hooks fire per chunk forward since the chunk calls the rank module). The metadata are
given in full (inputs and outputs), so torch's warm-up vote picks STATIC and no real forward runs before the
first step; torch then trusts them without a check, so the chunk checks each output against its metadata before
it is sent (a wrong dtype or shape would arrive as garbage in the next stage's buffer).

    first stage:  (tokens (mbs, S) int64)                      -> (hidden (mbs, S, D), aux ())
    middle stage: (hidden (mbs, S, D), aux ()), both with grad  -> (hidden, aux)
    last stage:   (hidden, aux)                                 -> loss ()

With context parallelism the hidden states are a cp rank's part of each sequence, (mbs, S / cp, D): each cp
coordinate's pipeline carries its own; the first stage still takes whole sequences (it splits them). With tensor
parallelism each tp coordinate's pipeline carries its own: (mbs, S, D), or under sequence parallelism the rank's
sequence shard (mbs, S / tp, D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
from torch import nn

from moezero.pipeline.layout import StagePiece
from moezero.pipeline.stage_model import StageModel


@dataclass(frozen=True)
class ActivationShape:
    """What travels between stages: the hidden states of one micro-batch and the carried aux loss."""

    micro_batch_size: int
    seq_length: int
    hidden_size: int
    dtype: torch.dtype  # the hidden states' (the model's)
    aux_dtype: torch.dtype  # the router losses'
    context_parallel_size: int = 1  # the hidden states hold a cp-th of each sequence
    sequence_shards: int = 1  # under sequence parallelism a tp-th of that (the rank's sequence shard)

    def hidden(self, requires_grad: bool) -> torch.Tensor:
        length = self.seq_length // self.context_parallel_size // self.sequence_shards
        return torch.empty(
            self.micro_batch_size, length, self.hidden_size, dtype=self.dtype, device="meta"
        ).requires_grad_(requires_grad)

    def aux(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty((), dtype=self.aux_dtype, device="meta").requires_grad_(requires_grad)

    def tokens(self) -> torch.Tensor:
        return torch.empty(self.micro_batch_size, self.seq_length, dtype=torch.int64, device="meta")

    def loss(self) -> torch.Tensor:
        return torch.empty(
            (), dtype=torch.promote_types(self.aux_dtype, torch.promote_types(self.dtype, torch.float32)), device="meta"
        )


def stage_metas(piece: StagePiece, shape: ActivationShape) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
    """(input_args, output_args) metadata (meta-device tensors) of a stage, for PipelineStage."""
    inputs = (shape.tokens(),) if piece.embedding else (shape.hidden(True), shape.aux(True))
    outputs = (shape.loss(),) if piece.head else (shape.hidden(True), shape.aux(True))
    return inputs, outputs


class StageChunk(nn.Module):
    """One stage of the rank's StageModel: forward(*inputs, **kwargs) = model(virtual_stage, *inputs, **kwargs)."""

    def __init__(self, model: StageModel, virtual_stage: int, shape: ActivationShape):
        super().__init__()
        object.__setattr__(self, "rank_model", model)  # not registered: the rank module owns the params
        self.piece = model.pieces[virtual_stage]
        self.virtual_stage = virtual_stage
        _, outputs = stage_metas(self.piece, shape)
        self._expected = tuple((tuple(t.shape), t.dtype) for t in outputs)

    def forward(self, *inputs: torch.Tensor, **kwargs):
        out = self.rank_model(self.virtual_stage, *inputs, **kwargs)
        got = tuple((tuple(t.shape), t.dtype) for t in (out if isinstance(out, tuple) else (out,)))
        if got != self._expected:
            raise RuntimeError(
                f"pipeline stage {self.piece.stage_index} produced {got}, its metadata say "
                f"{self._expected} (shape, dtype)"
            )
        return out
