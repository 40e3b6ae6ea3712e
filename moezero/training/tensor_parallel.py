"""Tensor parallelism applied to a built GPT model from outside, torch's parallelize_module style.

The model is built as today (the global model, every param from its keyed init) and knows no parallel layout
(models/ imports nothing of parallel/). `apply_tensor_parallel` then swaps its modules in place for Megatron's
tensor-parallel ones (parallel/tp_linear.py, vocab_parallel.py), each taking its slice of the global weight, so any
tp starts from the values tp 1 starts from:

| module | at tp > 1 |
|---|---|
| attention qkv | ColumnParallelLinear, parts [q (H h) | k (G h) | v (G h)]: rank r holds heads/groups block r |
| attention proj | RowParallelLinear |
| learnable softmax offsets (sinks) | the rank's heads (a TensorShard along dim 0) |
| per-head q/k norms | whole on every rank, gradient partial over tp (mark_tp_partial) |
| MLA q_proj or q_up, kv_up | ColumnParallelLinear: rank r holds heads block r (megatron-core's MLA) |
| MLA q_down, kv_down, latent norms | whole on every rank (Megatron's duplicated linears), as the layer norms |
| MLA shared RoPE key | whole per rank: all-gathered from the shards under SP, else its gradient summed over tp |
| dense MLP fc1 / fc2 | ColumnParallelLinear (parts [gate | up] under GLU) / RowParallelLinear |
| embedding | VocabParallelEmbedding (the padded vocabulary divides by tp, as Megatron pads it) |
| output layer | ColumnParallelLinear without gather: logits of the rank's vocabulary slice |
| tied output | the embedding's vocabulary shard, its input entering the tp region (GPTModel.tied_head_input) |
| loss | vocab_parallel_cross_entropy (GPTModel.token_losses) |

With sequence parallelism the residual stream, norms and dropout run on the rank's sequence shard (B, S/tp, D):
the embedding reduce-scatters, column-parallel layers all-gather their input, row-parallel ones reduce-scatter
their output, and the params replicated over tp whose gradient is then partial (norms, row-parallel biases) are
marked tp_partial, summed over tp by the optimizer.

Keyed dropout draws the masks of one process: the residual stream's on a sequence shard are the slices of the whole
sequence's (GPTModel.sequence_keys), attention's on the rank's heads the slices of every head's
(CausalSelfAttention.head_keys).

MoE layers need sequence parallelism (Megatron's rule): each rank routes its sequence shard, with the router's token
counts over the tp group (each rank's losses its share) and the routed experts split over ep as at tp 1, ep folded
over the tp ranks at expert-tensor-parallel size 1; at etp > 1 (Megatron's default: tp) each expert's ffn is split
over the etp group the MoE layers are built with (ParallelGroups.etp).

MTP depths are built as the decoder's layers (their norms and projection whole on every rank) and under sequence
parallelism learned position embeddings are looked up at the rank's positions.

With context parallelism (Megatron's semantics) the cp split comes first (the rank's 2 chunks of each sequence,
moezero/context_parallel.py), then sequence parallelism shards the rank's cp part over tp: attention exchanges the
K/V of the rank's heads over cp (a2a: a block of the rank's heads), positions and keyed draws are the cp rank's
(under SP each tp rank's shard of them: `_SequenceShardKeys`), and the routers count tokens over the tp-cp group.

A router under sequence parallelism sees the rank's sequence shard, as megatron-core's: capacity drops and sinkhorn's
balancing are decided on the shard's tokens (not those of the whole micro-batch one process decides on), the aux
and sequence aux losses count tokens over the tp-cp group, the global-batch aux loss over tp-dp-cp.

Without sequence parallelism megatron-core's MLA leaves the shared RoPE key's gradient the rank's heads' part (the
kv down-projection's rows of it then differ over tp); here it is summed over tp, as one process computes it.

What this does not build is refused in one line (`refusals`): full-width q/k norms,
query groups not divisible by tp, a sequence not divisible by tp under sequence parallelism, and MoE layers without
sequence parallelism; context parallelism with pipeline stages too (config/run.py).
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import nn

from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.context_parallel import HeadBlockKeys, ShardedSampleKeys
from moezero.keyed_random import SampleKeys
from moezero.models import GPTModel
from moezero.models.attention import CausalSelfAttention
from moezero.models.mla import MultiLatentAttention
from moezero.moe import MoELayer
from moezero.moe.experts import GATED, DenseMLP
from moezero.moe.load_balancing import SequenceShares
from moezero.parallel import comm
from moezero.parallel.groups import SharesProcessGroups
from moezero.parallel.tensor_marker import TensorShard, mark_tensor_parallel, mark_tp_partial
from moezero.parallel.tp_linear import ColumnParallelLinear, RowParallelLinear
from moezero.parallel.tp_regions import copy_to_tp, gather_from_sp
from moezero.parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy


def refusals(config: GPTConfig, moe: Optional[MoEConfig], tp: int, sequence_parallel: bool) -> List[str]:
    """One line per setting of the model that tensor parallelism of size `tp` does not run (empty: it runs)."""
    c, lines = config, []
    if tp == 1:
        return lines
    if c.num_attention_heads % tp:
        lines.append(f"--num-attention-heads {c.num_attention_heads} must be divisible by tensor parallel size {tp}")
    if c.query_groups % tp:
        lines.append(
            f"--num-query-groups {c.query_groups} must be divisible by tensor parallel size {tp} (replicating "
            "key/value heads over tensor-parallel ranks is not supported)"
        )
    if c.qk_layernorm and c.qk_layernorm_scope == "full_width":
        lines.append("full-width q/k norms are not supported with tensor parallelism (per-head ones are)")
    if moe is not None:
        lines += _moe_refusals(sequence_parallel)
    if sequence_parallel and c.seq_length % tp:  # each rank holds seq_length / tp positions
        lines.append(
            f"--seq-length {c.seq_length} must be divisible by tensor parallel size {tp} with --sequence-parallel"
        )
    if c.vocab_size is not None and c.vocab_size % tp:
        lines.append(f"a vocabulary of {c.vocab_size} does not split over tensor parallel size {tp}")
    return lines


def _moe_refusals(sequence_parallel: bool) -> List[str]:
    lines = []
    if not sequence_parallel:  # megatron-core's MoELayer raises in training
        lines.append("MoE layers with tensor parallelism need --sequence-parallel (as Megatron's)")
    return lines


def apply_tensor_parallel(model: GPTModel, group: Optional[Any], sequence_parallel: bool = False) -> GPTModel:
    """Swap `model`'s modules for their tensor-parallel versions over `group` (in place; returns the model).
    `group` None or of one rank: the model as it is."""
    tp = comm.group_size(group)
    if tp == 1:
        return model
    lines = refusals(model.config, model.moe_config, tp, sequence_parallel)
    if lines:  # what the run's checks refuse at start (tensor_parallel_checks.py), or a checkpoint's vocabulary
        raise ConfigError(f"--tensor-model-parallel-size={tp}: {'; '.join(lines)}")
    plan = _Plan(group, sequence_parallel)
    for layer in model.layers:
        plan.layer(layer, model.config)
    for depth in model.mtp or ():  # MTP: its layer as the decoder's, its norms and projection whole on every rank
        plan.layer(depth.layer, model.config)
        plan.replicated(depth.enorm, depth.hnorm, depth.eh_proj, depth.final_norm)
    plan.replicated(model.final_norm)
    model.embedding = plan.embedding(model.embedding)
    _swap_heads_and_hooks(model, plan)
    return model


def apply_tensor_parallel_to_stage(stage: nn.Module, group: Optional[Any], sequence_parallel: bool = False):
    """A pipeline rank's part of the GPT (pipeline/stage_model.py's StageModel: its layers by global number, the
    embedding on the first stage, the final norm and head on the last, there the word embedding's copy when tied)
    swapped as `apply_tensor_parallel` swaps the whole model (in place; returns the stage). Each tp coordinate's
    pipeline carries its own hidden states (under sequence parallelism the rank's sequence shard: `sequence_shards`)
    and its own copy of the tied embedding's vocabulary shard (pipeline/tied.py over its embedding group)."""
    tp = comm.group_size(group)
    if tp == 1:
        return stage
    lines = refusals(stage.config, stage.moe_config, tp, sequence_parallel)
    if lines:
        raise ConfigError(f"--tensor-model-parallel-size={tp}: {'; '.join(lines)}")
    plan = _Plan(group, sequence_parallel)
    for layer in stage.layers.values():
        plan.layer(layer, stage.config)
    for depth in (stage.mtp or {}).values():  # on the last stage: as apply_tensor_parallel's
        plan.layer(depth.layer, stage.config)
        plan.replicated(depth.enorm, depth.hnorm, depth.eh_proj, depth.final_norm)
    if stage.final_norm is not None:
        plan.replicated(stage.final_norm)
    if stage.embedding is not None:
        stage.embedding = plan.embedding(stage.embedding)
    if stage.embedding_copy is not None:  # not registered: the first stage's optimizer steps the shard (tied.py)
        object.__setattr__(stage, "embedding_copy", plan.embedding(stage.embedding_copy))
    _swap_heads_and_hooks(stage, plan)
    if sequence_parallel:
        stage.sequence_shards = tp
    return stage


def _swap_heads_and_hooks(model: nn.Module, plan: "_Plan") -> None:
    """The position embedding (under sequence parallelism), the output layer or the tied head's input, the loss and
    the sequence shard's keys, of a GPTModel or a pipeline stage (whichever of them it holds)."""
    group, sequence_parallel = plan.group, plan.sequence_parallel
    if model.position_embedding is not None and sequence_parallel:
        model.position_embedding = _SequenceShardPositions(model.position_embedding, group)
    if model.output is not None:
        model.output = plan.column(model.output, gather_output=False)
    else:
        model.tied_head_input = _TpRegionInput(group, sequence_parallel)
    model.token_losses = _VocabParallelLoss(group)
    if sequence_parallel:
        model.sequence_keys = _SequenceShardKeys(group)


class _Plan:
    """The swaps, over one group."""

    def __init__(self, group: Any, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)

    def column(self, linear: nn.Linear, gather_output: bool = False, parts=None) -> ColumnParallelLinear:
        layer = ColumnParallelLinear(
            linear.in_features,
            linear.out_features,
            self.group,
            bias=linear.bias is not None,
            gather_output=gather_output,
            sequence_parallel=self.sequence_parallel,
            parts=parts,
            dtype=linear.weight.dtype,
        )
        return layer.to(linear.weight.device).copy_from_global_(linear.weight, linear.bias)

    def row(self, linear: nn.Linear) -> RowParallelLinear:
        layer = RowParallelLinear(
            linear.in_features,
            linear.out_features,
            self.group,
            bias=linear.bias is not None,
            sequence_parallel=self.sequence_parallel,
            dtype=linear.weight.dtype,
        )
        return layer.to(linear.weight.device).copy_from_global_(linear.weight, linear.bias)

    def layer(self, layer: nn.Module, config: GPTConfig) -> None:
        """A TransformerLayer: its attention, its MLP (dense or MoE) and its norms."""
        if isinstance(layer.attention, MultiLatentAttention):
            self.latent_attention(layer.attention)
        else:
            self.attention(layer.attention)
        if isinstance(layer.mlp, MoELayer):
            self.moe(layer.mlp)
        else:
            self.mlp(layer.mlp, config)
        self.replicated(layer.input_norm, layer.mlp_norm)

    def attention(self, attention: CausalSelfAttention) -> None:
        heads, groups, h = attention.heads, attention.groups, attention.head_dim
        attention.qkv = self.column(attention.qkv, parts=(heads * h, groups * h, groups * h))
        attention.proj = self.row(attention.proj)
        attention.heads, attention.groups = heads // self.size, groups // self.size
        attention.head_keys = _HeadBlockKeys(heads, self.rank, self.size)
        offset = attention.softmax_offset
        if isinstance(offset, nn.Parameter):
            shard = TensorShard.split(tuple(offset.shape), 0, self.rank, self.size)
            attention.softmax_offset = nn.Parameter(shard.local_of(offset.detach()))
            mark_tensor_parallel(attention.softmax_offset, shard)
        elif offset is not None:  # a constant buffer
            attention.softmax_offset = TensorShard.split(tuple(offset.shape), 0, self.rank, self.size).local_of(offset)
        for norm in (attention.q_norm, attention.k_norm):
            if norm is not None:  # per head: each rank's heads give part of its weight's gradient
                for p in norm.parameters():
                    mark_tp_partial(p)

    def latent_attention(self, attention: MultiLatentAttention) -> None:
        """megatron-core's MLA layout: the up-projections (or q_proj) column-parallel over the heads, proj
        row-parallel, the down-projections and latent norms whole (under SP on the rank's sequence shard: partial
        gradients), the shared RoPE key whole on each rank."""
        heads = attention.heads
        for name in ("q_proj", "q_up", "kv_up"):
            if getattr(attention, name) is not None:
                setattr(attention, name, self.column(getattr(attention, name)))
        attention.proj = self.row(attention.proj)
        attention.heads = heads // self.size
        attention.head_keys = _HeadBlockKeys(heads, self.rank, self.size)
        attention.key_position_region = _TpRegionInput(self.group, self.sequence_parallel)
        latents = (attention.q_down, attention.q_norm, attention.kv_down, attention.kv_norm)
        self.replicated(*(module for module in latents if module is not None))

    def mlp(self, mlp: DenseMLP, config: GPTConfig) -> None:
        ffn = mlp.fc2.in_features
        parts = (ffn, ffn) if mlp.activation in GATED else None
        mlp.fc1 = self.column(mlp.fc1, parts=parts)
        mlp.fc2 = self.row(mlp.fc2)

    def moe(self, moe: MoELayer) -> None:
        """Under sequence parallelism (required) each rank routes its sequence shard: the router counts tokens over
        the tp group (its losses are the rank's shares, megatron-core's tp-cp counting) and every param of the
        layer that is whole on each rank (router, shared expert and its gate) gets a partial gradient. Routed
        experts stay whole, split over ep (folded over the tp ranks, ParallelGroups), reduced over edp."""
        moe.router.cp = _TensorContextShares(SequenceShares(self.group), moe.router.cp)
        moe.router.global_balancing.shards = SequenceShares(self.group)  # then over dp-cp: megatron-core's tp-dp-cp
        for module in (moe.router, moe.shared_expert, moe.shared_expert_gate):
            if module is not None:
                self.replicated(module)

    def replicated(self, *modules: nn.Module) -> None:
        """Norms on the rank's sequence shard under sequence parallelism: their gradients are partial."""
        if self.sequence_parallel:
            for module in modules:
                for p in module.parameters():
                    mark_tp_partial(p)

    def embedding(self, embedding: nn.Embedding) -> VocabParallelEmbedding:
        layer = VocabParallelEmbedding(
            embedding.num_embeddings,
            embedding.embedding_dim,
            self.group,
            sequence_parallel=self.sequence_parallel,
            dtype=embedding.weight.dtype,
        )
        return layer.to(embedding.weight.device).copy_from_global_(embedding.weight)


class _SequenceShardPositions(nn.Embedding):
    """The learned position embedding under sequence parallelism: asked for a whole sequence's positions it looks
    up the rank's contiguous 1/tp of them (the residual stream's shard); whole on every rank, each rank's gradient
    its rows' part (tp_partial)."""

    def __init__(self, source: nn.Embedding, group: Any):
        super().__init__(source.num_embeddings, source.embedding_dim, _weight=source.weight.detach().clone())
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)
        mark_tp_partial(self.weight)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        shard = positions.shape[0] // self.size
        return super().forward(positions.narrow(0, self.rank * shard, shard))


class _TpRegionInput(SharesProcessGroups):
    """The tied head's input entering the tensor-parallel region: the sequence all-gathered under sequence
    parallelism, else as is with its gradient summed over the group (each rank's from its vocabulary slice)."""

    def __init__(self, group: Any, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel

    def __call__(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sp(x_BSD, self.group)
        return copy_to_tp(x_BSD, self.group)


class _SequenceShardKeys(SharesProcessGroups):
    """Keys of the rank's contiguous sequence shard: each per-token draw (dropout on the residual stream) is the
    slice of the whole sequence's, so the masks are those of one process."""

    def __init__(self, group: Any):
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)

    def __call__(self, keys: SampleKeys, sequence_length: int) -> SampleKeys:
        """`keys` of a `sequence_length` sequence (a cp rank's part: ShardedSampleKeys, its shard of its
        positions) for the rank's shard of it."""
        shard = sequence_length // self.size
        if isinstance(keys, ShardedSampleKeys):  # context parallelism: the cp split first, then SP's shard of it
            return ShardedSampleKeys(
                keys, keys.positions[self.rank * shard : (self.rank + 1) * shard], keys.sequence_length
            )
        positions = torch.arange(self.rank * shard, (self.rank + 1) * shard)
        return ShardedSampleKeys(keys, positions, sequence_length)


class _HeadBlockKeys:
    """Attention-dropout keys of the rank's block of heads: the whole sequence's mask over every head, at the
    rank's heads (from the keys of the whole sequence, also when the residual stream holds a shard of it)."""

    def __init__(self, heads: int, rank: int, size: int):
        local = heads // size
        self.heads, self.block = heads, slice(rank * local, (rank + 1) * local)

    def __call__(self, keys: Any) -> HeadBlockKeys:
        if isinstance(keys, HeadBlockKeys):  # a2a context parallelism: a block of this rank's heads
            return HeadBlockKeys(keys.whole, self.heads, self.block).of_block(keys.block)
        return HeadBlockKeys(SampleKeys(keys.seed, keys.iteration, keys.sample_ids), self.heads, self.block)


class _TensorContextShares(SharesProcessGroups):
    """A router's token counts under tensor x context parallelism: over megatron-core's tp-cp group, the tp group's
    sums summed over the cp group (the same ranks: every tp rank of every cp rank; exact for counts), each rank's
    losses its share of the whole sequences' (size: tp x cp)."""

    def __init__(self, tp: SequenceShares, cp: SequenceShares):
        self.tp, self.cp = tp, cp
        self.size = tp.size * cp.size

    def sum(self, counts: torch.Tensor) -> torch.Tensor:
        return self.cp.sum(self.tp.sum(counts))


class _VocabParallelLoss(SharesProcessGroups):
    """Per-token cross-entropy of logits split over the group's vocabulary slices."""

    def __init__(self, group: Any):
        self.group = group

    def __call__(self, logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_NV, labels_N, self.group)
