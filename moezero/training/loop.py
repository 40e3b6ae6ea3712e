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
    layer_aux_loss: torch.Tensor      # (MoE layers,): each layer's load-balancing loss (times its coefficient)
    layer_z_loss: torch.Tensor        # (MoE layers,): each layer's z-loss (times its coefficient)

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


_LAYER_MEANS = 3   # per MoE layer: aux loss, z loss, dropped fraction (averaged), then tokens per expert (summed)


def _layer_rows(stats, like: torch.Tensor) -> torch.Tensor:
    if not stats:
        return like.new_zeros(0, dtype=torch.float64)
    return torch.stack([torch.cat([torch.stack([t.double() for t in (s.aux_loss, s.z_loss, s.dropped_fraction)]),
                                   s.tokens_per_expert.double()]) for s in stats]).detach().reshape(-1)


def train_step(model, opt, micro_batches: Sequence[Dict[str, torch.Tensor]], iteration: int, seed: int,
               group) -> StepMetrics:
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
        per_micro.append(torch.cat([torch.stack([lm, aux, z]).detach().double(), _layer_rows(stats, lm)]))
    stepped = opt.step()
    opt.zero_grad()
    totals = torch.stack(per_micro).sum(0).cpu()
    comm.all_reduce(totals, group)   # one all-reduce for every metric
    return _step_metrics(totals, len(stats), n * comm.group_size(group), opt.last_grad_norm, stepped)


def _step_metrics(totals: torch.Tensor, layers: int, micro_batches: int, grad_norm, stepped: bool) -> StepMetrics:
    """From sums over every micro-batch of every rank: losses and drop fractions averaged, counts summed."""
    lm, aux, z = (totals[:3] / micro_batches).tolist()
    rows = totals[3:].view(layers, -1) if layers else torch.zeros(0, _LAYER_MEANS)
    means = rows[:, :_LAYER_MEANS] / micro_batches
    return StepMetrics(lm, aux, z, grad_norm if grad_norm is not None else float("nan"), stepped,
                       tokens_per_expert=rows[:, _LAYER_MEANS:], dropped_fraction=means[:, 2],
                       layer_aux_loss=means[:, 0], layer_z_loss=means[:, 1])


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


def moe_loss_scalars(layer_numbers: Sequence[int], m: StepMetrics, moe, per_layer: bool) -> Dict[str, float]:
    """Megatron's MoE loss scalars: each loss without its coefficient, the mean over MoE layers, and with
    `per_layer` each layer's (tags as megatron-core's MoE metrics tracker writes them)."""
    losses = []
    if moe.aux_loss_coeff and moe.load_balancing_type != "none":
        name = "load_balancing_loss" if moe.load_balancing_type == "aux_loss" else "seq_load_balancing_loss"
        losses.append((name, m.layer_aux_loss / moe.aux_loss_coeff))
    if moe.z_loss_coeff:
        losses.append(("z_loss", m.layer_z_loss / moe.z_loss_coeff))
    out: Dict[str, float] = {}
    for name, values in losses:
        out[tag("moe_loss", loss=name)] = values.mean().item()
        if per_layer:
            out.update({tag("moe_layer_loss", loss=name, layer=layer): value
                        for layer, value in zip(layer_numbers, values.tolist())})
    return out
