"""One pipeline rank's part of a GPTModel: the layers (and embedding, final norm, head) of its stages, under
GPTModel's parameter names and with GPTModel's keyed init, so its params equal the full model's by construction.

    model = StageModel(config, moe_config, seed, plan, pp_rank, moe_layer=expert_parallel(groups.stage))
    model.named_parameters()   # "embedding.weight", "layers.0.attention...", "layers.1.mlp.experts.w1", ...

`layers` is a ModuleDict keyed by the global layer number, so `layers.5.…` names what GPTModel's ModuleList names;
each layer is built by GPTModel's own `TransformerLayer` and `build_mlp` with its global number (MoE pattern,
windows, dropout and jitter sites), and every param is initialised from (seed, its full name[, global expert]) by
`init_keyed_` with GPTModel's `init_std`. `forward(virtual_stage, ...)` runs one of the rank's stages (a chunk,
`chunk.py`): the first stage embeds tokens; every stage runs its layers (full recompute counted over the stage's
own layers, as Megatron counts --recompute-num-layers per stage) and adds its MoE layers' router losses to the
carried `aux` (design brief 4.4: the aux losses of every stage reach the loss, their gradient returns through the
pipe); the last stage returns the micro-batch's loss lm + aux, which the schedule's loss function scales.

Tied embedding and output weights: the last stage's output layer uses `output_copy`, a copy of the first stage's
word embedding keyed alike (so equal at init), not registered as a param: the first stage's optimizer steps the
weight and the copy follows (tied.py). Not yet (refused in one line): MTP depths.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import ConfigError, GPTConfig, MoEConfig, is_moe_layer, moe_layer_config
from moezero.keyed_random import SampleKeys, init_keyed_
from moezero.models.attention import norm_layer, recomputing
from moezero.models.gpt import (
    MoELayerFactory,
    TransformerLayer,
    build_mlp,
    embed_tokens,
    init_std,
    language_model_loss,
    recompute_chunks,
)
from moezero.moe import MoELayer, MoEStats
from moezero.pipeline.layout import PipelinePlan, StagePiece


def check_stage_model_supported(config: GPTConfig) -> None:
    """What the stage execution does not run yet, one line each."""
    if config.mtp_num_layers:
        raise ConfigError(
            f"--mtp-num-layers={config.mtp_num_layers}: MTP depths with "
            "--pipeline-model-parallel-size > 1 are not supported yet"
        )


def moe_layer_numbers(config: GPTConfig, has_moe: bool) -> Tuple[int, ...]:
    """The model's MoE layers by global number (the metrics' slots, every rank alike)."""
    if not has_moe:
        return ()
    return tuple(layer for layer in range(config.num_layers) if is_moe_layer(layer, config.moe_layer_freq))


class StageModel(nn.Module):
    """The stages `plan` gives pipeline rank `pp_rank`, as one module under GPTModel's names.

    forward(virtual_stage, *inputs, seed, iteration, sample_index, labels=None, loss_mask=None):
      first stage: inputs (tokens_BS,); others: (hidden_BSD, aux). Returns (hidden_BSD, aux), or on the last stage
      the micro-batch's loss (lm + aux, the aux of every stage's MoE layers). `recorder` (set by the step driver)
      is given each chunk forward's MoE stats and lm loss, detached.
    """

    def __init__(
        self,
        config: GPTConfig,
        moe_config: Optional[MoEConfig],
        seed: int,
        plan: PipelinePlan,
        pp_rank: int,
        moe_layer: MoELayerFactory = MoELayer,
    ):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set (the training script takes it from the tokenizer)")
        if plan.num_layers != config.num_layers:
            raise ValueError(f"the pipeline plan has {plan.num_layers} layers, the model {config.num_layers}")
        check_stage_model_supported(config)
        plan.check_supported()
        self.config = config
        self.pieces: Tuple[StagePiece, ...] = plan.pieces_of(pp_rank)
        layer_moe = moe_layer_config(config, moe_config, seed) if moe_config is not None else None
        self.moe_config = layer_moe
        self.embedding = self.position_embedding = None
        if any(piece.embedding for piece in self.pieces):
            self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
            if config.position_embedding_type == "learned_absolute":
                self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleDict(
            {
                str(layer): TransformerLayer(config, build_mlp(config, layer, layer_moe, moe_layer), layer)
                for piece in self.pieces
                for layer in piece.layers
            }
        )
        self.final_norm = norm_layer(config) if any(piece.final_norm for piece in self.pieces) else None
        self.output = None
        output_copy = None
        if any(piece.head for piece in self.pieces):
            if config.untie_embeddings_and_output_weights:
                self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            elif self.embedding is None:  # tied: the last stage's copy of the first stage's word embedding
                output_copy = nn.Embedding(config.vocab_size, config.hidden_size)
                init_keyed_(output_copy, seed, functools.partial(init_std, config), prefix="embedding.")
        # not registered: the first stage's optimizer steps the weight, the copy follows it (tied.py)
        object.__setattr__(self, "output_copy", output_copy)
        init_keyed_(self, seed, functools.partial(init_std, config))
        self.recorder = None

    def _apply(self, fn, recurse=True):
        """.to(dtype/device) and friends reach the unregistered copy too."""
        super()._apply(fn, recurse)
        if self.output_copy is not None:
            self.output_copy._apply(fn, recurse)
        return self

    def _logits(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(x_BSD)
        tied = self.embedding if self.embedding is not None else self.output_copy
        return F.linear(x_BSD, tied.weight)

    @property
    def moe_layers(self) -> Tuple[int, ...]:
        return moe_layer_numbers(self.config, self.moe_config is not None)

    def aux_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The carried aux loss's dtype: the router losses' (fp32 at least, --moe-router-dtype fp64: fp64)."""
        dtype = torch.promote_types(model_dtype, torch.float32)
        if self.moe_config is not None and self.moe_config.router_dtype == "fp64":
            dtype = torch.float64
        return dtype

    def forward(
        self,
        virtual_stage: int,
        *inputs: torch.Tensor,
        seed: int,
        iteration: int,
        sample_index: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
    ):
        piece = self.pieces[virtual_stage]
        keys = SampleKeys(seed, iteration, tuple(sample_index.tolist()))
        if piece.embedding:
            (tokens_BS,) = inputs
            x = embed_tokens(self, tokens_BS, keys)
            aux = x.new_zeros((), dtype=self.aux_dtype(x.dtype))
        else:
            x, aux = inputs
        x, stats = self._run_layers(piece.layers, x, keys)
        for s in stats:
            for value in s.losses.values():
                aux = aux + value
        lm = None
        if piece.final_norm:
            x = self.final_norm(x)
        if piece.head:
            lm = language_model_loss(self._logits(x), labels, loss_mask, fused=self.config.cross_entropy_loss_fusion)
        if self.recorder is not None:
            self.recorder.record(piece, stats, lm, loss_mask)
        if piece.head:
            return lm + aux
        return x, aux

    def _run_layers(
        self, layers: Tuple[int, ...], x: torch.Tensor, keys: SampleKeys
    ) -> Tuple[torch.Tensor, List[MoEStats]]:
        all_stats: List[MoEStats] = []
        for first, last, recompute in recompute_chunks(self.config, len(layers)):
            run = layers[first:last]
            if recompute and recomputing(self):
                x, stats = checkpoint(self._layers, run, x, keys, use_reentrant=False)
            else:
                x, stats = self._layers(run, x, keys)
            all_stats += stats
        return x, all_stats

    def _layers(
        self, layers: Tuple[int, ...], x: torch.Tensor, keys: SampleKeys
    ) -> Tuple[torch.Tensor, List[MoEStats]]:
        all_stats = []
        for layer in layers:
            x, stats = self.layers[str(layer)](x, keys)
            if stats is not None:
                all_stats.append(stats)
        return x, all_stats
