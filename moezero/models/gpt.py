"""A GPT decoder for one device; every `moe_layer_freq`-th MLP is an MoELayer.

Shapes: B batch, S sequence, D hidden, H heads, h head dim, V vocabulary.

The model is built from its configs alone and knows no parallel layout: expert parallelism comes
in from outside as the factory that builds its MoE layers (`moezero.moe.expert_parallel(groups)`),
and ZeRO wraps the finished model.
Dropout draws from keys (seed, iteration, global sample index, site) when `SampleKeys` are
passed, so its masks do not depend on the parallel layout and recompute redraws them exactly.
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import GPTConfig, MoEConfig, is_moe_layer, is_window_layer, moe_layer_config
from moezero.keyed_random import SampleKeys, init_keyed_, is_bias, keyed_dropout
from moezero.models.attention import CausalSelfAttention, norm_layer, recomputing
from moezero.models.mla import MultiLatentAttention
from moezero.models.mtp import MultiTokenPredictionLayer, recomputes_mtp, run_mtp_depth
from moezero.moe import MoELayer, MoEStats
from moezero.moe.experts import DenseMLP
from moezero.ops.cross_entropy import token_cross_entropy
from moezero import phases

MoELayerFactory = Callable[..., MoELayer]  # (config, layer_number=i) -> the MoE MLP of layer i


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is dense or MoE."""

    def __init__(self, config: GPTConfig, mlp: nn.Module, layer_number: int, context_parallel: Optional[Any] = None):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.site = f"layer{layer_number}"
        self.input_norm = norm_layer(config)
        if config.multi_latent_attention:
            self.attention = MultiLatentAttention(
                config, site=f"{self.site}.attention", layer_number=layer_number, context_parallel=context_parallel
            )
        else:
            window = config.window_size[0] if is_window_layer(layer_number, config) else None
            self.attention = CausalSelfAttention(
                config,
                site=f"{self.site}.attention",
                window=window,
                layer_number=layer_number,
                context_parallel=context_parallel,
            )
        self.mlp_norm = norm_layer(config)
        self.moe_recompute = config.moe_layer_recompute or config.recomputes("moe")
        self.mlp_recompute, self.norm_recompute = config.recomputes("mlp"), config.recomputes("layernorm")
        self.mlp = mlp  # registered last: the params' order (ZeRO's bucket order) is input_norm ... mlp

    def forward(self, x_BSD: torch.Tensor, keys: Optional[SampleKeys]):
        return phases.run(self.forward_steps(x_BSD, keys, phased=False))

    def forward_steps(self, x_BSD: torch.Tensor, keys: Optional[SampleKeys], phased: bool = True) -> phases.Steps:
        """forward() in phases (moezero.phases): with `phased`, the MoE layer's."""
        attn = self.attention(self._norm(self.input_norm, x_BSD), keys)
        x_BSD = x_BSD + keyed_dropout(attn, self.hidden_dropout, self.training, keys, self.site + ".attn_out")
        h = self._norm(self.mlp_norm, x_BSD)
        stats = None
        if isinstance(self.mlp, MoELayer) and self.moe_recompute and recomputing(self):
            out, stats = checkpoint(self.mlp, h, keys, use_reentrant=False)
        elif isinstance(self.mlp, MoELayer) and phased:
            out, stats = yield from phases.module_steps(self.mlp, h, keys)
        elif isinstance(self.mlp, MoELayer):
            out, stats = self.mlp(h, keys)
        elif self.mlp_recompute and recomputing(self):
            out = checkpoint(self.mlp, h, use_reentrant=False)
        else:
            out = self.mlp(h)
        x_BSD = x_BSD + keyed_dropout(out, self.hidden_dropout, self.training, keys, self.site + ".mlp_out")
        return x_BSD, stats

    def _norm(self, norm: nn.Module, x_BSD: torch.Tensor) -> torch.Tensor:
        """--recompute-modules layernorm: the norm's output is recomputed in backward, not kept."""
        if self.norm_recompute and recomputing(self):
            return checkpoint(norm, x_BSD, use_reentrant=False)
        return norm(x_BSD)


class GPTModel(nn.Module):
    """Decoder-only language model.

    Args:
        config: sizes, positions, norms, dropout, recompute.
        moe_config: the MoE layers' settings (hidden size and activation are taken from `config`),
            or None for a dense model.
        seed: keys the layout-invariant init: each param from (seed, its name[, global expert]).
        moe_layer: builds each MoE layer (default: all experts on this device); expert parallelism
            passes `moezero.moe.expert_parallel(groups)`.
        context_parallel: this rank's place in its cp group (moezero/context_parallel.py): forward then takes
            this rank's part of each sequence (ContextParallel.split_micro_batch) and returns its logits.

    forward(tokens_BS, keys=None) -> (logits_BSV, [MoEStats of each MoE layer])
    """

    def __init__(
        self,
        config: GPTConfig,
        moe_config: Optional[MoEConfig] = None,
        seed: int = 0,
        moe_layer: MoELayerFactory = MoELayer,
        context_parallel: Optional[Any] = None,
    ):
        super().__init__()
        if context_parallel is not None and context_parallel.size == 1:
            context_parallel = None
        self.context_parallel = context_parallel
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set (the training script takes it from the tokenizer)")
        self.config = config
        # seams for a tensor-parallel plan applied from outside (training/tensor_parallel.py): what the tied head's
        # input passes through before the product with the (vocabulary shard of the) embedding, and the per-token
        # loss of the logits this model returns (None: token_cross_entropy of whole-vocabulary logits)
        self.tied_head_input: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.token_losses: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
        # and the keys of the residual stream's draws when it holds a part of each sequence (sequence parallelism):
        # (keys, sequence length) -> keys for that part
        self.sequence_keys: Optional[Callable[[SampleKeys, int], SampleKeys]] = None
        layer_moe = moe_layer_config(config, moe_config, seed) if moe_config is not None else None
        self.moe_config = layer_moe  # what every MoE layer is built from (None: a dense model)
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                TransformerLayer(config, self._mlp(i, layer_moe, moe_layer), i, context_parallel)
                for i in range(config.num_layers)
            ]
        )
        self.final_norm = norm_layer(config)
        self.output = None
        if config.untie_embeddings_and_output_weights:
            self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = None
        if config.mtp_num_layers:  # Megatron's: each depth's MLP is of the last layer's kind
            last_kind = config.num_layers - 1
            self.mtp = nn.ModuleList(
                [
                    MultiTokenPredictionLayer(
                        config,
                        TransformerLayer(
                            config,
                            self._mlp(last_kind, layer_moe, moe_layer, config.num_layers + k),
                            config.num_layers + k,
                            context_parallel,
                        ),
                    )
                    for k in range(config.mtp_num_layers)
                ]
            )
        init_keyed_(self, seed, self._init_std)

    def _mlp(
        self,
        layer_number: int,
        moe_config: Optional[MoEConfig],
        moe_layer: MoELayerFactory,
        number: Optional[int] = None,
    ) -> nn.Module:
        return build_mlp(self.config, layer_number, moe_config, moe_layer, number)

    def _init_std(self, name: str, param: torch.Tensor) -> Optional[float]:
        return init_std(self.config, name, param)

    def forward(
        self,
        tokens_BS: torch.Tensor,
        keys: Optional[SampleKeys] = None,
        mtp: bool = False,
        mtp_tokens: Optional[torch.Tensor] = None,
    ):
        """(logits, MoE stats); with `mtp` (a model with --mtp-num-layers), (logits, MoE stats of the decoder's
        and the MTP layers', [logits of each MTP depth]). `mtp_tokens` (depths, B, S): each depth's input tokens
        (default: `tokens_BS` shifted; a context-parallel rank's are shifted on the whole sequence first)."""
        return phases.run(self.forward_steps(tokens_BS, keys, mtp, phased=False, mtp_tokens=mtp_tokens))

    def forward_steps(
        self,
        tokens_BS: torch.Tensor,
        keys: Optional[SampleKeys] = None,
        mtp: bool = False,
        phased: bool = True,
        mtp_tokens: Optional[torch.Tensor] = None,
    ) -> phases.Steps:
        """forward() in phases (moezero.phases): with `phased`, the MoE layers' (a recomputed chunk of
        layers and the MTP depths run whole)."""
        if self.context_parallel is not None:
            if mtp and self.mtp is not None and mtp_tokens is None:  # a shift of the rank's part mixes its chunks
                raise ValueError(
                    "a context-parallel rank's MTP depths need their tokens shifted on the whole sequence "
                    "(mtp_tokens: ContextParallel.split_micro_batch)"
                )
            keys = self.context_parallel.keys(keys, tokens_BS.shape[1])
        if self.sequence_keys is not None and keys is not None:
            keys = self.sequence_keys(keys, tokens_BS.shape[1])
        x = embed_tokens(self, tokens_BS, keys)
        all_stats: List[MoEStats] = []
        for first, last, recompute in recompute_chunks(self.config):
            if recompute and recomputing(self):
                x, stats = checkpoint(self._layers, first, last, x, keys, use_reentrant=False)
            else:
                x, stats = yield from self._layer_steps(first, last, x, keys, phased)
            all_stats += stats
        x = self.final_norm(x)
        if not mtp:
            return self._logits(x), all_stats
        depth_logits = [self._logits(hidden) for hidden in self._mtp_depths(tokens_BS, x, keys, all_stats, mtp_tokens)]
        return self._logits(x), all_stats, depth_logits

    def _logits(self, x_BSD: torch.Tensor) -> torch.Tensor:
        # an untied head is called as a module, so whatever wraps modules (ZeRO-3 engines) sees it run
        if self.output is not None:
            return self.output(x_BSD)
        if self.tied_head_input is not None:
            x_BSD = self.tied_head_input(x_BSD)
        return F.linear(x_BSD, self.embedding.weight)

    def _mtp_depths(
        self,
        tokens_BS: torch.Tensor,
        hidden: torch.Tensor,
        keys: Optional[SampleKeys],
        all_stats: List[MoEStats],
        mtp_tokens: Optional[torch.Tensor] = None,
    ):
        """Each MTP depth's hidden states in turn (its MoE stats appended to `all_stats`); Megatron recomputes
        the depths with --recompute-method uniform."""
        recompute = recomputes_mtp(self.config)
        for k, module in enumerate(self.mtp or ()):
            hidden, stats = run_mtp_depth(
                k,
                module,
                self.embedding,
                tokens_BS,
                hidden,
                keys,
                self.config,
                self.training,
                recompute and recomputing(self),
                None if mtp_tokens is None else mtp_tokens[k],
            )
            if stats is not None:
                all_stats.append(stats)
            yield hidden

    def _layers(self, first: int, last: int, x: torch.Tensor, keys: Optional[SampleKeys]):
        """Layers [first, last) in order; their MoE stats."""
        return phases.run(self._layer_steps(first, last, x, keys, phased=False))

    def _layer_steps(
        self, first: int, last: int, x: torch.Tensor, keys: Optional[SampleKeys], phased: bool
    ) -> phases.Steps:
        all_stats = []
        for layer in self.layers[first:last]:
            x, stats = (yield from phases.module_steps(layer, x, keys)) if phased else layer(x, keys)
            if stats is not None:
                all_stats.append(stats)
        return x, all_stats


def build_mlp(
    config: GPTConfig,
    layer_number: int,
    moe_config: Optional[MoEConfig],
    moe_layer: MoELayerFactory,
    number: Optional[int] = None,
) -> nn.Module:
    """Layer `layer_number`'s kind of MLP (an MoE one numbered `number`, default `layer_number`)."""
    if moe_config is not None and is_moe_layer(layer_number, config.moe_layer_freq):
        return moe_layer(moe_config, layer_number=layer_number if number is None else number)
    c = config
    return DenseMLP(
        c.hidden_size,
        c.ffn_hidden_size,
        c.mlp_activation(),
        bias=not c.disable_bias_linear,
        offset=c.glu_linear_offset,
        clamp=c.activation_func_clamp_value,
    )


def init_std(config: GPTConfig, name: str, param: torch.Tensor) -> Optional[float]:
    """Megatron's init of the param called `name` (GPTModel's names): N(0, std) weights, output projections scaled
    by 1/sqrt(2L); biases zero, norm weights their ones (None: as built)."""
    if is_bias(name):
        return 0.0
    if name.endswith(("softmax_offset", "router.wg.bias")):  # Megatron's: its init method, as a weight's
        return config.init_method_std
    if param.ndim < 2:
        return None
    std = config.init_method_std
    if name.endswith(("attention.proj.weight", "mlp.fc2.weight", "experts.w2", "shared_expert.fc2.weight")):
        std /= math.sqrt(2.0 * config.num_layers)
    return std


def embed_tokens(model: nn.Module, tokens_BS: torch.Tensor, keys: Optional[SampleKeys]) -> torch.Tensor:
    """The decoder's input: word (+ learned position) embeddings and their dropout, from `model`'s `embedding`,
    `position_embedding` and `config` (a GPTModel, or a pipeline stage holding them under the same names)."""
    x = model.embedding(tokens_BS)
    if model.position_embedding is not None:
        cp = getattr(model, "context_parallel", None)
        if cp is None:
            positions = torch.arange(tokens_BS.shape[1], device=tokens_BS.device)
        else:
            positions = cp.positions(tokens_BS.shape[1], tokens_BS.device)
        x = x + model.position_embedding(positions)
    return keyed_dropout(x, model.config.hidden_dropout, model.training, keys, "embedding")


def recompute_chunks(config: GPTConfig, num_layers: Optional[int] = None) -> List[Tuple[int, int, bool]]:
    """(first, last, recomputed) runs of layers: Megatron's full recompute checkpoints chunks of
    --recompute-num-layers layers (uniform) or each of the first --recompute-num-layers layers (block), counted
    over `num_layers` (default the model's; a pipeline stage's own, as Megatron counts per stage)."""
    n, k = config.num_layers if num_layers is None else num_layers, config.recompute_num_layers
    if config.recompute_granularity != "full":
        return [(0, n, False)]
    if config.recompute_method == "uniform":
        return [(i, min(i + k, n), True) for i in range(0, n, k)]
    return [(i, i + 1, True) for i in range(min(k, n))] + ([(k, n, False)] if k < n else [])


def language_model_loss(
    logits_BSV: torch.Tensor,
    labels_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    fused: bool = False,
    token_losses: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """Mean token cross-entropy of one micro-batch (fp32), over the positions the mask keeps; `fused`:
    --cross-entropy-loss-fusion (moezero.ops.cross_entropy); `token_losses` (N, V), (N,) -> (N,): the model's own
    per-token loss (GPTModel.token_losses, e.g. over a vocabulary split across ranks)."""
    logits_NV, labels_N = logits_BSV.reshape(-1, logits_BSV.shape[-1]), labels_BS.reshape(-1)
    if token_losses is None:
        losses = token_cross_entropy(logits_NV, labels_N, fused)
    else:
        losses = token_losses(logits_NV, labels_N)
    mask = loss_mask_BS.reshape(-1).to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
