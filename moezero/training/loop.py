"""One training step (micro-batches with gradient accumulation) and one evaluation, in lockstep.

Every rank runs the same number of micro-steps (each MoE forward is a collective under EP), and
metrics are all-reduced on every rank before anyone writes them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence

import torch

from moezero.keyed_random import SampleKeys
from moezero.metrics import tag
from moezero.models import language_model_loss
from moezero.moe.expert_bias import ExpertBiasUpdater
from moezero.parallel import comm


@dataclass(frozen=True)
class StepMetrics:
    """Averages over the global batch (every micro-batch of every rank)."""

    lm_loss: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    stepped: bool
    tokens_per_expert: torch.Tensor   # (MoE layers, E): global assignments per expert this step
    dropped_fraction: torch.Tensor    # (MoE layers,): mean over micro-batches and ranks

    def values(self) -> Dict[str, float]:
        """The scalar metrics, under their names in `moezero.metrics.METRICS`."""
        return {"lm_loss": self.lm_loss, "aux_loss": self.aux_loss, "z_loss": self.z_loss, "grad_norm": self.grad_norm}


def _micro_batch_losses(model, batch, keys):
    device = model.embedding.weight.device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    logits, stats = model(batch["tokens"], keys)
    lm = language_model_loss(logits, batch["labels"], batch["loss_mask"])
    aux = sum((s.aux_loss for s in stats), lm.new_zeros(()))
    z = sum((s.z_loss for s in stats), lm.new_zeros(()))
    return lm, aux, z, stats


def train_step(model, opt, micro_batches: Sequence[Dict[str, torch.Tensor]], iteration: int, seed: int,
               bias_updater: ExpertBiasUpdater, group) -> StepMetrics:
    """Forward/backward every (loaded) micro-batch (loss / n: the optimizer averages over ranks), then step."""
    model.train()
    n = len(micro_batches)
    per_micro: List[torch.Tensor] = []  # metrics stay on the device; one host transfer per step
    for j, batch in enumerate(micro_batches):
        keys = SampleKeys(seed, iteration, tuple(batch["sample_index"].tolist()))
        # earlier micro-steps only accumulate (stage 0/1 reduce once, overlapped with the last backward)
        with opt.no_sync() if j < n - 1 else contextlib.nullcontext():
            lm, aux, z, stats = _micro_batch_losses(model, batch, keys)
            opt.backward((lm + aux + z) / n)
        bias_updater.accumulate(stats)
        per_micro.append(torch.cat([torch.stack([lm, aux, z]).detach().double()] +
                                   [s.tokens_per_expert.detach().double() for s in stats] +
                                   [torch.stack([s.dropped_fraction for s in stats]).detach().double()
                                    if stats else lm.new_zeros(0, dtype=torch.float64)]))
    stepped = opt.step()
    opt.zero_grad()
    bias_updater.step()
    totals = torch.stack(per_micro).sum(0).cpu()
    layers = len(stats)
    counts = totals[3:-layers].view(layers, -1) if layers else None
    dropped = totals[-layers:] / n if layers else None
    return _reduce_metrics(totals[:3] / n, counts, dropped, opt.last_grad_norm, stepped, group)


def _reduce_metrics(means, layer_counts, layer_dropped, grad_norm, stepped, group) -> StepMetrics:
    """One all-reduce for everything; losses and drop fractions are averaged over ranks."""
    layers = 0 if layer_counts is None else layer_counts.shape[0]
    parts = [means]
    if layers:
        parts += [layer_counts.reshape(-1), layer_dropped]
    flat = torch.cat(parts)
    comm.all_reduce(flat, group)
    size = comm.group_size(group)
    lm, aux, z = (flat[:3] / size).tolist()
    counts = flat[3:3 + layer_counts.numel()].view_as(layer_counts) if layers else torch.zeros(0, 0)
    dropped = flat[3 + counts.numel():] / size if layers else torch.zeros(0)
    return StepMetrics(lm, aux, z, grad_norm if grad_norm is not None else float("nan"), stepped, counts, dropped)


@torch.no_grad()
def evaluate(model, micro_batches: Iterable[Dict[str, torch.Tensor]], group) -> float:
    """Mean lm loss over the given (loaded) micro-batches of every rank (a collective: all ranks call it)."""
    model.eval()
    total = torch.zeros(1, dtype=torch.float64)
    losses = [_micro_batch_losses(model, batch, None)[0].double() for batch in micro_batches]
    if losses:
        total += torch.stack(losses).sum().cpu()
    total /= max(len(losses), 1)
    comm.all_reduce(total, group)
    model.train()
    return float(total.item()) / comm.group_size(group)


def expert_load_scalars(layer_numbers: Sequence[int], tokens_per_expert: torch.Tensor, dropped: torch.Tensor
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
