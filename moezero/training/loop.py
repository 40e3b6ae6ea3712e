"""One training step (micro-batches with gradient accumulation) and one evaluation, in lockstep.

Every rank runs the same number of micro-steps (each MoE forward is a collective under EP), and
metrics are all-reduced on every rank before anyone writes them.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from moezero.keyed_random import SampleKeys, keyed_seed
from moezero.metrics import mtp_loss_metric, tag
from moezero.models import language_model_loss
from moezero.models.mtp import mtp_losses, shift_left
from moezero.moe import MoEStats, reset_global_load_balancing
from moezero import phases
from moezero.parallel import comm
from moezero.parallel.batch_agreement import SharedBatchCheck, agree_evaluation_batch, agree_evaluation_end
from moezero.context_parallel import ContextParallel


@dataclass(frozen=True)
class StepMetrics:
    """Averages over the global batch (every micro-batch of every rank); counts summed."""

    lm_loss: float
    router_losses: Dict[str, float]  # MoEStats.LOSSES (times their coefficients), summed over MoE layers
    grad_norm: float
    stepped: bool
    tokens_per_expert: torch.Tensor  # (MoE layers, E): global assignments per expert this step
    dropped_fraction: torch.Tensor  # (MoE layers,)
    layer_tracked_losses: Dict[str, torch.Tensor]  # each router loss without its coefficient per MoE layer,
    # (MoE layers,), under megatron-core's tracker names
    mtp_losses: Tuple[float, ...] = ()  # each MTP depth's loss (without the scaling factor)

    def values(self) -> Dict[str, float]:
        """The scalar metrics, under their names in `moezero.metrics.METRICS`."""
        router = {f"router_{name}": value for name, value in self.router_losses.items()}
        # a skipped step has no gradient norm (Megatron's optimizer returns None: its log leaves it out)
        norm = {"grad_norm": self.grad_norm} if self.stepped else {}
        return {"lm_loss": self.lm_loss, **router, **self.mtp_values(), **norm}

    def mtp_values(self) -> Dict[str, float]:
        """Each MTP depth's loss under its metric name (Megatron's 'mtp_1 loss', ...)."""
        return {mtp_loss_metric(k + 1): value for k, value in enumerate(self.mtp_losses)}


def _micro_batch_losses(model, batch, keys, mtp: bool = False):
    """(lm loss, {router loss: value}, MoE stats, [each MTP depth's loss]); the MTP depths run with `mtp` (training:
    Megatron's evaluation loss is the lm loss alone)."""
    return phases.run(_micro_batch_steps(model, batch, keys, mtp, phased=False))


def _micro_batch_steps(model, batch, keys, mtp: bool, phased: bool) -> phases.Steps:
    """_micro_batch_losses in phases (moezero.phases): with `phased`, the model's forward's. A context-parallel
    rank's `batch` (ContextParallel.split_micro_batch) brings each MTP depth's tokens, labels and mask shifted."""
    device = model.embedding.weight.device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    mtp = mtp and model.mtp is not None
    extra = {"mtp_tokens": batch["mtp_tokens"]} if mtp and "mtp_tokens" in batch else {}
    if phased:
        logits, stats, *depths = yield from phases.module_steps(model, batch["tokens"], keys, mtp=mtp, **extra)
    else:
        logits, stats, *depths = model(batch["tokens"], keys, mtp=mtp, **extra)
    loss = functools.partial(
        language_model_loss,
        fused=model.config.cross_entropy_loss_fusion,
        token_losses=getattr(model, "token_losses", None),
    )
    lm = loss(logits, batch["labels"], batch["loss_mask"])
    router = {name: sum((s.losses[name] for s in stats), lm.new_zeros(())) for name in MoEStats.LOSSES}
    depth_losses = []
    if mtp and "mtp_labels" in batch:  # shifted on the whole sequence, then split
        depth_losses = [
            loss(depth_logits, batch["mtp_labels"][k], batch["mtp_loss_mask"][k])
            for k, depth_logits in enumerate(depths[0])
        ]
    elif mtp:
        depth_losses = mtp_losses(depths[0], batch["labels"], batch["loss_mask"], loss)
    return lm, router, stats, depth_losses


def _mtp_term(model, depth_losses: List[torch.Tensor], batch, token_share: Optional[float]) -> torch.Tensor:
    """What the MTP depths add to a micro-batch's loss (Megatron's): mtp_loss_scaling_factor / depths x the sum
    of their losses; with --calculate-per-token-loss each depth's token sum over the global batch's lm tokens
    (`token_share`: this micro-batch's lm tokens x ranks / the global batch's)."""
    if not depth_losses:
        return torch.zeros(())
    scale = model.config.mtp_loss_scaling_factor / len(depth_losses)
    if token_share is None:
        return scale * sum(depth_losses)
    tokens = batch["loss_mask"].sum().clamp(min=1.0)
    counts = [_depth_mask(batch, k).sum() for k in range(len(depth_losses))]
    return scale * token_share * sum(loss * (count / tokens).to(loss) for loss, count in zip(depth_losses, counts))


def _depth_mask(batch, k: int) -> torch.Tensor:
    """MTP depth k's loss mask (a context-parallel rank's: shifted on the whole sequence before the split)."""
    return batch["mtp_loss_mask"][k] if "mtp_loss_mask" in batch else shift_left(batch["loss_mask"], k + 1)


def _named_metrics(
    lm: torch.Tensor,
    loss_mask: torch.Tensor,
    router: Dict[str, torch.Tensor],
    stats,
    depths: List[torch.Tensor],
    cp_size: int = 1,
) -> Dict[str, torch.Tensor]:
    """One micro-batch's metrics by name, detached (summed over micro-batches and ranks next); the lm loss as its
    token sum and count, so that the step's is the global batch's token mean (Megatron's 'lm loss'). A
    context-parallel rank's losses are its shares of the micro-batch's (`depths` too), its drop fraction its
    own (divided by `cp_size` here: a share of the mean over the group's equal parts)."""
    layers = {
        f"tracked_{name}": torch.stack([s.tracked[name] for s in stats]) for name in (stats[0].tracked if stats else {})
    }
    per_layer = {
        "dropped_fraction": torch.stack([s.dropped_fraction / cp_size for s in stats]) if stats else lm.new_zeros(0),
        "tokens_per_expert": torch.stack([s.tokens_per_expert for s in stats]) if stats else lm.new_zeros(0, 0),
    }
    per_layer["mtp_losses"] = torch.stack(depths) if depths else lm.new_zeros(0)
    tokens = loss_mask.sum().to(lm.device, torch.float64)
    lm_sums = {"lm_loss": lm.detach().double() * tokens, "lm_tokens": tokens}
    return {name: t.detach().double() for name, t in dict(**lm_sums, **router, **layers, **per_layer).items()}


class _Packed:
    """Named tensors as one float64 vector and back: one host transfer and one all-reduce per step."""

    def __init__(self, named: Dict[str, torch.Tensor]):
        self.shapes = {name: t.shape for name, t in named.items()}

    def pack(self, named: Dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([named[name].reshape(-1) for name in self.shapes])

    def unpack(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        sizes = [math.prod(shape) for shape in self.shapes.values()]
        return {name: t.view(shape) for (name, shape), t in zip(self.shapes.items(), flat.split(sizes))}


def train_step(
    model,
    opt,
    micro_batches: Sequence[Dict[str, torch.Tensor]],
    iteration: int,
    seed: int,
    group,
    per_token_loss: bool = False,
    overlap_moe_comm: bool = False,
    context_parallel: Optional[ContextParallel] = None,
    tensor_parallel_size: int = 1,
    batch_group=None,
) -> StepMetrics:
    """Forward/backward every (loaded) micro-batch (loss / n: the optimizer averages over ranks), then step.
    `per_token_loss` (--calculate-per-token-loss): the gradient is Megatron's, (the token sum of the lm losses +
    the router losses each times its tokens) / the global batch's loss tokens.
    `overlap_moe_comm` (--overlap-moe-expert-parallel-comm): micro-batches go in pairs whose forwards run
    interleaved (one's MoE exchanges travel while the other computes) and whose backward is one, interleaved the
    same way; the same numbers.
    `context_parallel`: this rank's cp group's (ranks of one cp group get the same whole micro-batches, split
    here): each loss is this rank's share of the micro-batch's, times the cp size, since the optimizer averages
    over every rank (Megatron's loss_func and its dp-cp reduction).
    `tensor_parallel_size`: the ranks of `group` that compute each micro-batch together: their lm and MTP losses are
    copies (the lm's token sums and counts both tp times, the same mean), their router losses shares of the
    micro-batch's.
    `batch_group` (ParallelGroups.batch_agreement_group): the ranks that read the same micro-batches (tp x cp); they
    agree on each one's place, shape and token ids before the step's first collective (parallel/batch_agreement.py).
    """
    model.train()
    shared_batches = SharedBatchCheck(batch_group, iteration, micro_batches)  # launched now, checked below
    n = len(micro_batches)
    cp_size = 1 if context_parallel is None else context_parallel.size
    whole_tokens: List[Optional[torch.Tensor]] = [None] * n
    if cp_size > 1:
        depths = len(model.mtp) if model.mtp is not None else 0
        splits = [context_parallel.split_micro_batch(batch, depths) for batch in micro_batches]
        micro_batches = [split.batch for split in splits]
        whole_tokens = [split.whole_tokens for split in splits]
    shared_batches.check()
    tokens = _GlobalTokens.count(micro_batches, group) if per_token_loss else None
    per_micro: List[torch.Tensor] = []  # metrics stay on the device; one host transfer per step
    packed = None
    together = 2 if overlap_moe_comm else 1
    for first in range(0, n, together):
        js = range(first, min(first + together, n))
        # earlier micro-steps only accumulate (stage 0/1 reduce once, overlapped with the last backward)
        with opt.no_sync() if js[-1] < n - 1 else contextlib.nullcontext():
            forwards = [
                _micro_batch_steps(
                    model, micro_batches[j], _keys(seed, iteration, micro_batches[j]), mtp=True, phased=len(js) > 1
                )
                for j in js
            ]
            results = phases.run_interleaved(forwards)
            losses = []
            for j, (lm, router, stats, depths) in zip(js, results):
                batch = micro_batches[j]
                if whole_tokens[j] is not None:
                    losses.append(
                        _cp_micro_batch_loss(
                            model, batch, lm, router, stats, depths, n, tokens, whole_tokens[j], tensor_parallel_size
                        )
                    )
                    depths = _cp_depth_shares(batch, depths, whole_tokens[j])
                else:
                    losses.append(
                        _micro_batch_loss(model, batch, lm, router, stats, depths, n, tokens, tensor_parallel_size)
                    )
                # a rank's drop fraction is its part's: a (cp x tp)-th share of the micro-batch's under SP
                named = _named_metrics(lm, batch["loss_mask"], router, stats, depths, cp_size * tensor_parallel_size)
                if tensor_parallel_size > 1:  # each tp rank's MTP losses are copies: their sum counts them once
                    named["mtp_losses"] = named["mtp_losses"] / tensor_parallel_size
                packed = packed or _Packed(named)
                per_micro.append(packed.pack(named))
            opt.backward(sum(losses[1:], losses[0]))
    stepped = opt.step()
    opt.zero_grad()
    reset_global_load_balancing(model)  # the global-batch aux loss counts each step's tokens
    totals = torch.stack(per_micro).sum(0).cpu()
    comm.all_reduce(totals, group)  # one all-reduce for every metric
    # a cp group's ranks add up shares of the same micro-batches
    micro_batch_count = n * comm.group_size(group) // (cp_size * tensor_parallel_size)
    return _step_metrics(packed.unpack(totals), micro_batch_count, opt.last_grad_norm, stepped)


def _keys(seed: int, iteration: int, batch: Dict[str, torch.Tensor]) -> SampleKeys:
    return SampleKeys(seed, iteration, tuple(batch["sample_index"].tolist()))


def _micro_batch_loss(
    model, batch, lm, router, stats, depths, n: int, tokens: Optional["_GlobalTokens"], tp_size: int = 1
) -> torch.Tensor:
    """What one of n micro-batches adds to the loss that is backpropagated. `tp_size`: under tensor (sequence)
    parallelism the routers' losses are this rank's shares, their token weights its tp_size-th of the tokens."""
    if tokens is None:
        return (lm + sum(router.values()) + _mtp_term(model, depths, batch, None)) / n
    share = tokens.weight(float(batch["loss_mask"].sum()))
    # megatron-core's router attaches each loss times its tokens (MoEStats.token_weighted), and
    # finalize_model_grads divides every gradient by the global batch's loss tokens
    routers = sum((value for s in stats for value in s.token_weighted.values()), lm.new_zeros(()))
    return lm * share + tp_size * routers * tokens.weight(1.0) + _mtp_term(model, depths, batch, share)


def _cp_micro_batch_loss(
    model,
    batch,
    lm,
    router,
    stats,
    depths,
    n: int,
    tokens: Optional["_GlobalTokens"],
    whole_tokens: torch.Tensor,
    tp_size: int = 1,
) -> torch.Tensor:
    """_micro_batch_loss of a context-parallel rank: `lm` and `depths` are token means over this rank's part and
    the routers' losses already its shares (router.py); `whole_tokens` the whole micro-batch's loss tokens.
    `tp_size`: under tensor (sequence) parallelism too the routers see a tp_size-th of the rank's part."""
    cp_size = model.context_parallel.size
    if tokens is None:
        lm_share = lm * (batch["loss_mask"].sum().double() / whole_tokens[0].clamp(min=1.0)).to(lm)
        depth_shares = _cp_depth_shares(batch, depths, whole_tokens)
        return cp_size * (lm_share + sum(router.values()) + _mtp_term(model, depth_shares, batch, None)) / n
    # per-token: the weights count this rank's tokens over every rank's; the routers' token-weighted shares
    # count this rank's tokens, a cp_size-th of the micro-batch's (a (cp_size x tp_size)-th under SP)
    share = tokens.weight(float(batch["loss_mask"].sum()))
    routers = sum((value for s in stats for value in s.token_weighted.values()), lm.new_zeros(()))
    return lm * share + cp_size * tp_size * routers * tokens.weight(1.0) + _mtp_term(model, depths, batch, share)


def _cp_depth_shares(batch, depths: List[torch.Tensor], whole_tokens: torch.Tensor) -> List[torch.Tensor]:
    """Each MTP depth's token mean over this rank's part as its share of the whole micro-batch's."""
    return [
        loss * (_depth_mask(batch, k).sum().double() / whole_tokens[k + 1].clamp(min=1.0)).to(loss)
        for k, loss in enumerate(depths)
    ]


@dataclass(frozen=True)
class _GlobalTokens:
    """--calculate-per-token-loss: the global batch's loss tokens (every rank's micro-batches) and the ranks whose
    gradients the optimizer averages."""

    total: float
    ranks: int

    @classmethod
    def count(cls, micro_batches: Sequence[Dict[str, torch.Tensor]], group) -> "_GlobalTokens":
        """One all-reduce: every rank calls it."""
        total = torch.tensor([sum(float(batch["loss_mask"].sum()) for batch in micro_batches)], dtype=torch.float64)
        comm.all_reduce(total, group)
        return cls(float(total), comm.group_size(group))

    def weight(self, tokens: float) -> float:
        """The weight of a sum over `tokens` tokens, such that the ranks' average is the sum over the global
        batch's loss tokens (0 when they are none)."""
        return tokens * self.ranks / self.total if self.total else 0.0


def _step_metrics(totals: Dict[str, torch.Tensor], micro_batches: int, grad_norm, stepped: bool) -> StepMetrics:
    """From sums over every micro-batch of every rank: the lm loss the token mean, the other losses and drop
    fractions averaged over micro-batches, counts summed."""
    mean = {name: t / micro_batches for name, t in totals.items() if name != "tokens_per_expert"}
    return StepMetrics(
        _token_mean(totals["lm_loss"], totals["lm_tokens"]),
        {name: mean[name].item() for name in MoEStats.LOSSES},
        grad_norm if grad_norm is not None else float("nan"),
        stepped,
        tokens_per_expert=totals["tokens_per_expert"],
        dropped_fraction=mean["dropped_fraction"],
        layer_tracked_losses={name[len("tracked_") :]: t for name, t in mean.items() if name.startswith("tracked_")},
        mtp_losses=tuple(mean["mtp_losses"].tolist()),
    )


def _token_mean(loss_sum: torch.Tensor, tokens: torch.Tensor) -> float:
    return float(loss_sum) / float(tokens) if float(tokens) else 0.0


@torch.no_grad()
def evaluate(
    model,
    micro_batches: Iterable[Dict[str, torch.Tensor]],
    group,
    seed: Optional[int] = None,
    iteration: int = 0,
    split: str = "valid",
    context_parallel: Optional[ContextParallel] = None,
    batch_group=None,
) -> float:
    """The lm loss of the given (loaded) micro-batches of every rank as their token mean, Megatron's (a collective:
    all ranks call it). With `seed`, the router jitter and random logits, which Megatron's router draws in
    evaluation too, are keyed by (seed, `split`, `iteration`, sample) as training's are, so any layout draws the
    same; without it they come from torch's generator. `context_parallel`: each rank evaluates its part of the
    micro-batches. `batch_group`: the ranks reading the same micro-batches agree on each, and on their count
    (parallel/batch_agreement.py)."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # (token sum of the loss, tokens)
    count = 0
    for count, batch in enumerate(micro_batches, 1):
        agree_evaluation_batch(batch_group, iteration, count - 1, batch)
        if context_parallel is not None and context_parallel.size > 1:
            batch = context_parallel.split_micro_batch(batch, 0).batch
        tokens = batch["loss_mask"].sum().double()
        keys = None if seed is None else evaluation_keys(seed, split, iteration, batch)
        totals += torch.stack([_micro_batch_losses(model, batch, keys)[0].double().cpu() * tokens, tokens])
    agree_evaluation_end(batch_group, iteration, count)
    comm.all_reduce(totals, group)
    model.train()
    return _token_mean(totals[0], totals[1])


def evaluation_keys(seed: int, split: str, iteration: int, batch: Dict[str, torch.Tensor]) -> SampleKeys:
    """An evaluation's per-sample keys: a split's sample indices restart at 0, so the split keys the seed (a
    validation sample draws other numbers than the training sample of its index)."""
    return _keys(keyed_seed(seed, "evaluation", split), iteration, batch)


def expert_load_scalars(
    layer_numbers: Sequence[int], tokens_per_expert: torch.Tensor, dropped: torch.Tensor
) -> Dict[str, float]:
    """TensorBoard scalars per MoE layer: tokens per expert, max/mean load ratio and dropped fraction."""
    out: Dict[str, float] = {}
    for layer, counts, drop in zip(layer_numbers, tokens_per_expert, dropped):
        mean = counts.mean().item()
        out[tag("max_mean_load_ratio", layer=layer)] = counts.max().item() / mean if mean > 0 else 0.0
        out[tag("dropped_fraction", layer=layer)] = drop.item()
        for expert, count in enumerate(counts.tolist()):
            out[tag("tokens_per_expert", layer=layer, expert=expert)] = count
    return out


def moe_losses(m: StepMetrics) -> Dict[str, float]:
    """Megatron's MoE losses ({name: value}, names as megatron-core's MoE metrics tracker gives them): each
    loss the model has, without its coefficient, the mean over MoE layers."""
    return {name: values.mean().item() for name, values in m.layer_tracked_losses.items()}


def moe_layer_loss_scalars(layer_numbers: Sequence[int], m: StepMetrics) -> Dict[str, float]:
    """--moe-per-layer-logging: each MoE layer's losses, tagged as megatron-core's tracker writes them."""
    return {
        tag("moe_layer_loss", loss=name, layer=layer): value
        for name, values in m.layer_tracked_losses.items()
        for layer, value in zip(layer_numbers, values.tolist())
    }
