"""Fake quantization inside the forward: a weight parametrization and an activation hook.

`FakeQuantWeight` is registered with `torch.nn.utils.parametrize.register_parametrization`, so
every read of `module.weight` (or `experts.w1`, ...) returns the fake-quantized weight while the
Parameter object itself - its identity, storage, gradient hook and place in the optimizer's flat
buffer - stays untouched as `module.parametrizations.<attr>.original`. Nothing rebinds `.data`:
the fix for MoQ under ZeRO, where quantizing in place moved the bit16 params off the optimizer's
buffer and the next step wrote the unquantized master back over them.

Both read the current bits from a shared `QATState` that the `QATController` advances once per
optimizer step (bits None: not quantizing yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from moezero.compression.quantizer import fake_quantize, fake_quantize_per_token
from moezero.compression.shard_quant import ShardRows, fake_quantize_shard
from moezero.keyed_random import keyed_generator
from moezero.parallel.expert_marker import ExpertShard
from moezero.parallel.tensor_marker import TensorShard


@dataclass
class QATState:
    """Where the bit schedule stands; shared by the controller (writer) and the fake-quant modules."""

    step: int = 0  # optimizer steps done
    bits: Optional[int] = None  # bits of this step's forward; None = full precision


class FakeQuantWeight(nn.Module):
    """Parametrization w -> w_hat (group-wise fake quantization, straight-through gradient).

    Args:
        name: the weight's canonical name (keys stochastic rounding).
        units, groups: row layout (see quantizer.py); units = local experts of a stacked tensor.
        symmetric: scale only, or scale and zero point.
        stochastic: round stochastically in training mode (eval mode always rounds to nearest).
        seed: run seed; the noise of a unit is keyed by (seed, step, name, global expert index),
            so it is the same for any ep layout, every micro-batch and activation recompute.
        shard: where a stacked expert tensor sits among the global experts (None: dense).
        state: the shared QATState.
        tensor_shard: the weight's tensor-parallel (etp) shard, None when whole: its scales are then computed
            over `tp_group`, the ranks holding the other shards (shard_quant.py).
        tp_group: the process group of those ranks.
    """

    def __init__(
        self,
        name: str,
        units: int,
        groups: int,
        symmetric: bool,
        stochastic: bool,
        seed: int,
        shard: Optional[ExpertShard],
        state: QATState,
        tensor_shard: Optional[TensorShard] = None,
        tp_group: Optional[Any] = None,
    ):
        super().__init__()
        self.name, self.units, self.groups = name, units, groups
        self.symmetric, self.stochastic, self.seed = symmetric, stochastic, seed
        self.shard = shard
        self.state = state
        self.tensor_shard, self.tp_group = tensor_shard, tp_group
        self.rows = None if tensor_shard is None else ShardRows(tensor_shard, units, groups)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        bits = self.state.bits
        if bits is None:
            return w
        noise = self._noise(w) if self.stochastic and self.training else None
        if self.rows is not None:
            return fake_quantize_shard(w, bits, self.rows, self.symmetric, self.tp_group, noise)
        return fake_quantize(w, bits, self.units, self.groups, self.symmetric, noise)

    def _noise(self, w: torch.Tensor) -> torch.Tensor:
        """U[0, 1) per element, drawn per unit from its own key (fp32, on w's device); a tensor-parallel shard
        draws the whole unit's and keeps its own elements (as keyed init does), so every tp rounds alike."""
        step = self.state.step
        if self.shard is None:
            noise = _draw(w.shape, self.tensor_shard, keyed_generator(self.seed, "qat-rounding", step, self.name))
            return noise.to(w.device)
        item = None if self.tensor_shard is None else self.tensor_shard.item_shard()
        keys = [
            keyed_generator(self.seed, "qat-rounding", step, self.name, self.shard.global_index(i))
            for i in range(self.units)
        ]
        return torch.stack([_draw(w.shape[1:], item, key) for key in keys]).to(w.device)

    def extra_repr(self) -> str:
        return (
            f"{self.name}, units={self.units}, groups={self.groups}, symmetric={self.symmetric}, "
            f"stochastic={self.stochastic}"
        )


def _draw(local_shape: torch.Size, shard: Optional[TensorShard], generator: torch.Generator) -> torch.Tensor:
    """U[0, 1) of a whole tensor (unit) from `generator`, cut to this rank's shard of it when tensor-parallel."""
    if shard is None:
        return torch.rand(local_shape, generator=generator)
    return shard.local_of(torch.rand(shard.global_shape, generator=generator))


class ActivationFakeQuant:
    """Forward pre-hook: fake-quantize a module's first input per token while weights are quantized."""

    def __init__(self, bits: int, state: QATState):
        self.bits = bits
        self.state = state

    def __call__(self, module: nn.Module, args: tuple):
        if self.state.bits is None or not args:
            return None
        return (fake_quantize_per_token(args[0], self.bits),) + tuple(args[1:])
