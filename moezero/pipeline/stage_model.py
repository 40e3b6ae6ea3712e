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

MTP depths (--mtp-num-layers) sit on the last stage with the loss (Megatron's placement without a layout, and the
only one a layout's `m` may take here: mtp_standalone is refused), numbered and built as GPTModel's (`mtp.0.…`,
each depth's MLP of the last layer's kind), and run in training only (Megatron's evaluation loss is the lm loss).
They take the decoder's output after its final norm (on the stage of the last decoder layer: it may arrive through
the pipe), the word embedding of the shifted tokens and the output layer; their losses join the last stage's loss
as `training.loop` adds them (mtp_loss_scaling_factor / depths x their sum) and their MoE layers' router losses
join the aux.

The word embedding on the last stage: with tied embedding and output weights (the output layer's), or with MTP
depths (their input, tied or not, as Megatron's embedding group), the last stage uses `embedding_copy`, a copy of
the first stage's word embedding keyed alike (so equal at init), not registered as a param: the first stage's
optimizer steps the weight and the copy follows (tied.py).

Context parallelism (`context_parallel`, --context-parallel-size > 1): every stage holds this rank's part of each
sequence (moezero/context_parallel.py: the hidden states sent between stages are (mbs, S/cp, D)), its attention
exchanging keys and values over the stage's cp group. The stages take whole micro-batches and split them here: the
first its tokens, the last its labels, loss mask and MTP inputs (each depth's shifted on the whole sequence
first). The last stage's loss is `training.loop`'s at cp: each token mean a share of the micro-batch's, times cp
(the optimizer averages over the dp-cp ranks).

Tensor parallelism (--tensor-model-parallel-size > 1): the built stage's modules are swapped as GPTModel's
(training/tensor_parallel.py's `apply_tensor_parallel_to_stage`), which also sets the hooks GPTModel has for it
(the tied head's input, the vocab-parallel loss, the sequence shard's keys); under sequence parallelism the hidden
states sent between stages are the rank's sequence shard (mbs, S/tp, D) and the routers' token weights count it.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import GPTConfig, MoEConfig, is_moe_layer, moe_layer_config
from moezero.context_parallel import ContextParallel, SplitMicroBatch, split_sequence
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
from moezero.models.mtp import MultiTokenPredictionLayer, mtp_losses, recomputes_mtp, run_mtp_depth, shift_left
from moezero.moe import MoELayer, MoEStats
from moezero.pipeline.layout import PipelinePlan, StagePiece


def moe_layer_numbers(config: GPTConfig, has_moe: bool) -> Tuple[int, ...]:
    """The model's MoE layers by global number (the metrics' slots, every rank alike): the decoder's, then the MTP
    depths' (numbered on from the decoder's, with its last layer's kind of MLP), as pretrain logs them."""
    if not has_moe:
        return ()
    decoder = tuple(layer for layer in range(config.num_layers) if is_moe_layer(layer, config.moe_layer_freq))
    if config.num_layers - 1 not in decoder:
        return decoder
    return decoder + tuple(range(config.num_layers, config.num_layers + (config.mtp_num_layers or 0)))


def _mtp_depth(
    config: GPTConfig,
    depth: int,
    moe_config: Optional[MoEConfig],
    moe_layer: MoELayerFactory,
    context_parallel: Optional[ContextParallel],
):
    """MTP depth `depth` as GPTModel builds it: its layer numbered num_layers + depth, its MLP of the last layer's
    kind."""
    number = config.num_layers + depth
    mlp = build_mlp(config, config.num_layers - 1, moe_config, moe_layer, number)
    return MultiTokenPredictionLayer(config, TransformerLayer(config, mlp, number, context_parallel))


def mtp_term(
    config: GPTConfig,
    depth_losses: List[torch.Tensor],
    loss_mask: torch.Tensor,
    share,
    depth_masks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """What the MTP depths add to a micro-batch's loss, `training.loop._mtp_term`'s: mtp_loss_scaling_factor /
    depths x the sum of their losses; with --calculate-per-token-loss (`share`: the micro-batch's lm tokens' weight)
    each depth's loss times its own token count over the lm's, times `share` (`depth_masks`: each depth's loss mask,
    a cp rank's shifted before the split; default `loss_mask` shifted)."""
    scale = config.mtp_loss_scaling_factor / len(depth_losses)
    if share is None:
        return scale * sum(depth_losses)
    tokens = loss_mask.sum().clamp(min=1.0)
    masks = depth_masks if depth_masks is not None else [shift_left(loss_mask, k + 1) for k in range(len(depth_losses))]
    counts = [masks[k].sum() for k in range(len(depth_losses))]
    return scale * share * sum(loss * (count / tokens).to(loss) for loss, count in zip(depth_losses, counts))


class StageModel(nn.Module):
    """The stages `plan` gives pipeline rank `pp_rank`, as one module under GPTModel's names.

    forward(virtual_stage, *inputs, seed, iteration, sample_index, labels=None, loss_mask=None, tokens=None,
            token_weight=None):
      first stage: inputs (tokens_BS,); others: (hidden_BSD, aux). Returns (hidden_BSD, aux), or on the last stage
      the micro-batch's loss (lm + aux, the aux of every stage's MoE layers, + the MTP term: `tokens` are the
      MTP depths' input). `token_weight` (--calculate-per-token-loss): the weight of one loss token, by which
      every stage weighs its router losses' token sums and the last stage the lm's and MTP's (training.loop's).
      `recorder` (set by the step driver) is given each chunk forward's MoE stats, lm and MTP losses, detached.
    """

    def __init__(
        self,
        config: GPTConfig,
        moe_config: Optional[MoEConfig],
        seed: int,
        plan: PipelinePlan,
        pp_rank: int,
        moe_layer: MoELayerFactory = MoELayer,
        context_parallel: Optional[ContextParallel] = None,
    ):
        super().__init__()
        cp = context_parallel if context_parallel is not None and context_parallel.size > 1 else None
        self.context_parallel = cp  # read by embed_tokens (positions) too
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set (the training script takes it from the tokenizer)")
        if plan.num_layers != config.num_layers:
            raise ValueError(f"the pipeline plan has {plan.num_layers} layers, the model {config.num_layers}")
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
                str(layer): TransformerLayer(config, build_mlp(config, layer, layer_moe, moe_layer), layer, cp)
                for piece in self.pieces
                for layer in piece.layers
            }
        )
        self.final_norm = norm_layer(config) if any(piece.final_norm for piece in self.pieces) else None
        head = any(piece.head for piece in self.pieces)
        self.output = None
        if head and config.untie_embeddings_and_output_weights:
            self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        depths = [depth for piece in self.pieces for depth in piece.mtp]
        # GPTModel's names (mtp.0...); registered last, as GPTModel's
        self.mtp = (
            nn.ModuleDict({str(d): _mtp_depth(config, d, layer_moe, moe_layer, cp) for d in depths}) if depths else None
        )
        embedding_copy = None
        uses_embedding = (head and not config.untie_embeddings_and_output_weights) or self.mtp is not None
        if uses_embedding and self.embedding is None:  # the last stage's copy of the first stage's word embedding
            embedding_copy = nn.Embedding(config.vocab_size, config.hidden_size)
            init_keyed_(embedding_copy, seed, functools.partial(init_std, config), prefix="embedding.")
        # not registered: the first stage's optimizer steps the weight, the copy follows it (tied.py)
        object.__setattr__(self, "embedding_copy", embedding_copy)
        init_keyed_(self, seed, functools.partial(init_std, config))
        self.recorder = None
        # set by tensor parallelism (training/tensor_parallel.py), as GPTModel's: the tied head's input entering the
        # tp region, the per-token loss over vocabulary shards, and under sequence parallelism the keys of the
        # rank's sequence shard, which the hidden states hold (a `sequence_shards`-th of each sequence)
        self.tied_head_input = self.token_losses = self.sequence_keys = None
        self.sequence_shards = 1

    def _apply(self, fn, recurse=True):
        """.to(dtype/device) and friends reach the unregistered copy too."""
        super()._apply(fn, recurse)
        if self.embedding_copy is not None:
            self.embedding_copy._apply(fn, recurse)
        return self

    def train(self, mode: bool = True):
        """.train()/.eval() reach the unregistered copy too (a plug-in's parametrization of it, QAT's fake
        quantization, rounds stochastically in training only)."""
        super().train(mode)
        if self.embedding_copy is not None:
            self.embedding_copy.train(mode)
        return self

    @property
    def word_embedding(self) -> nn.Embedding:
        """The word embedding this rank uses: the first stage's, or the last stage's copy of it."""
        return self.embedding if self.embedding is not None else self.embedding_copy

    def _logits(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(x_BSD)
        if self.tied_head_input is not None:
            x_BSD = self.tied_head_input(x_BSD)
        return F.linear(x_BSD, self.word_embedding.weight)

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
        tokens: Optional[torch.Tensor] = None,
        token_weight: Optional[float] = None,
    ):
        piece = self.pieces[virtual_stage]
        keys = SampleKeys(seed, iteration, tuple(sample_index.tolist()))
        cp = self.context_parallel
        if piece.embedding:
            (tokens_BS,) = inputs
            local = tokens_BS if cp is None else split_sequence(tokens_BS, cp.size, cp.rank)
            keys = keys if cp is None else cp.keys(keys, local.shape[1])
            if self.sequence_keys is not None:
                keys = self.sequence_keys(keys, local.shape[1])
            x = embed_tokens(self, local, keys)
            aux = x.new_zeros((), dtype=self.aux_dtype(x.dtype))
        else:
            x, aux = inputs
            local = x.shape[1] * self.sequence_shards  # the cp rank's part; the hidden states hold its tp shard
            keys = keys if cp is None else cp.keys(keys, local)
            if self.sequence_keys is not None:
                keys = self.sequence_keys(keys, local)
        x, stats = self._run_layers(piece.layers, x, keys)
        if piece.final_norm:
            x = self.final_norm(x)
        split = None  # a cp rank's part of the head's inputs
        if piece.head and cp is not None:
            split = self._split_head_inputs(piece, tokens, labels, loss_mask, sample_index)
            labels, loss_mask = split.batch["labels"], split.batch["loss_mask"]
        depth_losses: List[torch.Tensor] = []
        if piece.head and piece.mtp and self.training:
            depth_losses = self._mtp_losses(piece.mtp, tokens, x, labels, loss_mask, keys, stats, split)
        aux = self._add_router_losses(aux, stats, token_weight)
        if not piece.head:
            if self.recorder is not None:
                self.recorder.record(piece, stats, None, None)
            return x, aux
        lm = language_model_loss(
            self._logits(x),
            labels,
            loss_mask,
            fused=self.config.cross_entropy_loss_fusion,
            token_losses=self.token_losses,
        )
        lm_part, depth_parts = lm, depth_losses  # a cp rank's: shares of the micro-batch's means
        if split is not None:
            lm_part, depth_parts = _token_shares(lm, loss_mask, depth_losses, split)
        if self.recorder is not None:
            self.recorder.record(piece, stats, lm, loss_mask, depth_parts)
        share = None if token_weight is None else token_weight * float(loss_mask.sum())
        if share is None:  # a token mean: a cp rank's shares, times cp (its gradients are averaged over dp-cp)
            loss = lm_part + aux
            if depth_parts:
                loss = loss + mtp_term(self.config, depth_parts, loss_mask, None)
            return loss if cp is None else cp.size * loss
        loss = lm * share + aux  # per token: `token_weight` counts this rank's tokens
        if depth_losses:
            masks = None if split is None else split.batch["mtp_loss_mask"]
            loss = loss + mtp_term(self.config, depth_losses, loss_mask, share, masks)
        return loss

    def _split_head_inputs(
        self,
        piece: StagePiece,
        tokens: Optional[torch.Tensor],
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        sample_index: torch.Tensor,
    ) -> SplitMicroBatch:
        """This cp rank's part of the whole micro-batch's labels and loss mask (and, training with MTP depths, their
        tokens, labels and masks shifted on the whole sequence), with the whole's loss tokens."""
        depths = max(piece.mtp) + 1 if piece.mtp and self.training else 0
        batch = {"labels": labels, "loss_mask": loss_mask, "sample_index": sample_index}
        if depths:
            if tokens is None:
                raise ValueError("the MTP stage needs the micro-batch's tokens (the `tokens` keyword)")
            batch["tokens"] = tokens
        return self.context_parallel.split_micro_batch(batch, depths)

    def _add_router_losses(
        self, aux: torch.Tensor, stats: List[MoEStats], token_weight: Optional[float]
    ) -> torch.Tensor:
        """The carried aux plus the stage's MoE layers' router losses (`token_weight`, --calculate-per-token-loss:
        each loss times its tokens, times the weight of one token, as training.loop's: a cp rank's tokens are a
        cp-th of the micro-batch's, hence times cp there; a sequence-parallel rank's a tp-th, hence times tp)."""
        if token_weight is not None and self.context_parallel is not None:
            token_weight = token_weight * self.context_parallel.size
        if token_weight is not None:
            token_weight = token_weight * self.sequence_shards
        for s in stats:
            if token_weight is None:
                for value in s.losses.values():
                    aux = aux + value
            else:
                for value in s.token_weighted.values():
                    aux = aux + value * token_weight
        return aux

    def _mtp_losses(
        self,
        depths: Tuple[int, ...],
        tokens_BS: torch.Tensor,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        keys: SampleKeys,
        stats: List[MoEStats],
        split: Optional[SplitMicroBatch] = None,
    ) -> List[torch.Tensor]:
        """Each MTP depth's loss, as GPTModel._mtp_depths and training.loop run them (its MoE stats appended to
        `stats`); Megatron recomputes the depths with --recompute-method uniform. `split`: a cp rank's inputs, each
        depth's tokens, labels and mask shifted on the whole sequence."""
        if tokens_BS is None:
            raise ValueError("the MTP stage needs the micro-batch's tokens (the `tokens` keyword)")
        config = self.config
        recompute = recomputes_mtp(config) and recomputing(self)
        # at tp > 1 each depth's logits are the rank's vocabulary shard, as the lm's
        loss = functools.partial(
            language_model_loss, fused=config.cross_entropy_loss_fusion, token_losses=self.token_losses
        )
        logits = []
        shifted = None if split is None else split.batch["mtp_tokens"]
        for k in depths:
            hidden, depth_stats = run_mtp_depth(
                k,
                self.mtp[str(k)],
                self.word_embedding,
                tokens_BS,
                hidden,
                keys,
                config,
                self.training,
                recompute,
                None if shifted is None else shifted[k],
            )
            if depth_stats is not None:
                stats.append(depth_stats)
            logits.append(self._logits(hidden))
        if split is None:
            return mtp_losses(logits, labels, loss_mask, loss)
        batch = split.batch
        return [loss(logit, batch["mtp_labels"][k], batch["mtp_loss_mask"][k]) for k, logit in zip(depths, logits)]

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


def _token_shares(
    lm: torch.Tensor, loss_mask: torch.Tensor, depth_losses: List[torch.Tensor], split: SplitMicroBatch
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """A cp rank's token means (the lm's, each MTP depth's) as their shares of the whole micro-batch's
    (`training.loop._cp_micro_batch_loss`'s)."""
    whole = split.whole_tokens.clamp(min=1.0)
    lm_share = lm * (loss_mask.sum().double() / whole[0]).to(lm)
    masks = split.batch.get("mtp_loss_mask")
    depths = [loss * (masks[k].sum().double() / whole[k + 1]).to(loss) for k, loss in enumerate(depth_losses)]
    return lm_share, depths
