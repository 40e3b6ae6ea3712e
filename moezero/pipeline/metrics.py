"""A pipeline step's metrics, recorded by each chunk forward and summed over every rank of every stage.

Each stage sees only its own MoE layers and only the last stage sees the lm loss, so the per-step vector has a
*global* layout that every rank builds alike from the config: the lm loss's token sum and count, each router loss
summed over layers, and per MoE layer (by global number) its tracked losses, dropped fraction and tokens per
expert; a rank writes its own slots and leaves the others zero. One float64 all-reduce over the world then gives
the sums `training.loop`'s single-pipeline step computes over its ranks' micro-batches, and the same
`_step_metrics` turns them into a StepMetrics (averages over every micro-batch of every pipeline).
Recorded from the chunk's forward, not inside the layers: a recomputed layer does not record twice.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from moezero.moe import MoEStats
from moezero.moe.load_balancing import TRACKER_NAMES
from moezero.pipeline.layout import StagePiece


def tracked_loss_names(moe_config) -> Tuple[str, ...]:
    """The router's tracked (logged) losses by megatron-core's tracker names, in the router's order."""
    if moe_config is None:
        return ()
    names = [TRACKER_NAMES[kind] for kind in moe_config.balancing_coefficients()]
    return tuple(names + (["z_loss"] if moe_config.z_loss_coeff else []))


class StepRecorder:
    """One step's metrics of this rank, in the global layout (see the module's docstring)."""

    def __init__(
        self,
        moe_layers: Sequence[int],
        num_experts: int,
        tracked: Sequence[str],
        num_layers: int,
        mtp_depths: int = 0,
        sequence_parts: int = 1,
        tp_rank: int = 0,
    ):
        self.moe_layers, self.num_layers = tuple(moe_layers), num_layers
        # a rank's drop fraction is its own part's (cp, under SP its tp shard of it): a share of the micro-batch's
        self.sequence_parts = sequence_parts
        # the MTP depths' losses are replicated over the tp ranks (the vocab-parallel loss's): counted once
        self.counts_replicated = tp_rank == 0
        self._slot = {layer: k for k, layer in enumerate(self.moe_layers)}
        layers = len(self.moe_layers)
        self.totals: Dict[str, torch.Tensor] = {
            "lm_loss": torch.zeros((), dtype=torch.float64),
            "lm_tokens": torch.zeros((), dtype=torch.float64),
            **{name: torch.zeros((), dtype=torch.float64) for name in MoEStats.LOSSES},
            **{f"tracked_{name}": torch.zeros(layers, dtype=torch.float64) for name in tracked},
            "dropped_fraction": torch.zeros(layers, dtype=torch.float64),
            "tokens_per_expert": torch.zeros(layers, num_experts if layers else 0, dtype=torch.float64),
            "mtp_losses": torch.zeros(mtp_depths, dtype=torch.float64),
        }

    def record(
        self,
        piece: StagePiece,
        stats: List[MoEStats],
        lm: Optional[torch.Tensor],
        loss_mask: Optional[torch.Tensor],
        depth_losses: Sequence[torch.Tensor] = (),
    ) -> None:
        """One chunk forward: `stats` of the piece's MoE layers in layer order (then its MTP depths' when they ran:
        `depth_losses`, each depth's loss); `lm` on the last stage. A cp rank's losses are its shares of the
        micro-batch's (its lm loss a token mean over its `loss_mask`)."""
        totals = self.totals
        numbers = piece.layers
        if depth_losses:  # the depths' layers are numbered on from the decoder's (stage_model.moe_layer_numbers)
            numbers += tuple(self.num_layers + k for k in piece.mtp)
        layers = [layer for layer in numbers if layer in self._slot]
        if len(layers) != len(stats):
            raise RuntimeError(
                f"stage {piece.stage_index} returned the stats of {len(stats)} MoE layers, it holds {len(layers)}"
            )
        with torch.no_grad():
            for layer, s in zip(layers, stats):
                k = self._slot[layer]
                for name, value in s.losses.items():
                    totals[name] += value.detach().double().cpu()
                for name, value in s.tracked.items():
                    totals[f"tracked_{name}"][k] += value.detach().double().cpu()
                totals["dropped_fraction"][k] += s.dropped_fraction.detach().double().cpu() / self.sequence_parts
                totals["tokens_per_expert"][k] += s.tokens_per_expert.detach().double().cpu()
            for k, loss in enumerate(depth_losses if self.counts_replicated else ()):
                totals["mtp_losses"][k] += loss.detach().double().cpu()
            if lm is not None:
                tokens = loss_mask.sum().double().cpu()
                totals["lm_loss"] += lm.detach().double().cpu() * tokens
                totals["lm_tokens"] += tokens

    def pack(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.totals.values()])

    def unpack(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        sizes = [math.prod(t.shape) for t in self.totals.values()]
        return {name: part.view(t.shape) for (name, t), part in zip(self.totals.items(), flat.split(sizes))}
