"""Quantization-aware training on a model: `apply_qat` attaches it, `QATController` drives it.

    qat = apply_qat(model, qat_config, groups, seed)   # before ZeroOptimizer(model, ...)
    opt = ZeroOptimizer(model, ...)
    for step in ...: train_step(...); qat.on_step_end(step + 1)   # after every optimizer step
    logger.log(qat.scalars(), step)                    # collective over ep
    saved["qat"] = qat.state_dict()

`QATController` is a training plug-in (`moezero.training.plugin`); `moezero.recipe` plugs it in.

Implements MoQ-style QAT (DeepSpeed's Mixture-of-Quantization: a bit schedule that lowers the
precision during training) with fake quantization in the forward and straight-through gradients,
so the optimizer's fp32 master shards stay full precision and keep accumulating small updates.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from moezero.compression.config import ACTIVATION_GROUPS, MODULE_GROUPS, QATConfig
from moezero.compression.fake_quant import ActivationFakeQuant, FakeQuantWeight, QATState
from moezero.compression.quantizer import quantize_rows, to_rows
from moezero.compression.shard_quant import ShardRows, quantize_shard
from moezero.compression.bits_schedule import bits_at
from moezero.compression.targets import QuantTarget, check_groups_divide, quant_targets
from moezero.metrics import tag
from moezero.moe.experts import GroupedExperts
from moezero.parallel import ParallelGroups, comm

PLUGIN_NAME = "qat"  # its state's name in a checkpoint's plug-in states


class QATController:
    """Owns the bit schedule of a QAT run and reports on it.

    Args:
        config: the QATConfig.
        targets: the quantized weights (from `quant_targets`).
        state: the QATState the model's fake-quant modules read.
        ep_group: process group over which the experts are split (None: a world of one); the
            quantization error of expert weights is summed over it.
        shard_groups: (tp, etp) process groups: a tensor-parallel weight's scales and error are computed over the
            first, an expert stack split over etp over the second (None: whole weights).
        sum_over_stages: with pipeline stages (each holding its own layers' targets), the in-place sum of a
            tensor over the rank's pipeline (PipelineGroups.sum_over_stages): the error and the module groups are
            the whole model's. A collective at construction.
    """

    def __init__(
        self,
        config: QATConfig,
        targets: Sequence[QuantTarget],
        state: QATState,
        ep_group: Optional[object] = None,
        sum_over_stages: Optional[Callable[[torch.Tensor], None]] = None,
        shard_groups: Tuple[Optional[object], Optional[object]] = (None, None),
    ):
        self.config = config
        self.shard_groups = shard_groups
        self.targets = list(targets)
        self.state = state
        self.ep_group = ep_group
        self.sum_over_stages = sum_over_stages
        self._module_groups = list(dict.fromkeys(t.group for t in self.targets))
        if sum_over_stages is not None:
            self._module_groups = self._groups_of_every_stage()
        self._set_step(0)

    # ---- the schedule ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.state.step

    @property
    def bits(self) -> Optional[int]:
        """Bits of the next forward (None: full precision, before --qat-schedule-offset)."""
        return self.state.bits

    def _set_step(self, step: int) -> None:
        c = self.config
        self.state.step = step
        self.state.bits = bits_at(step, c.first_bits, c.weight_bits, c.bits_period, c.schedule_offset)

    def on_step_end(self, iteration: int) -> None:
        """After an optimizer step: the schedule stands at `iteration` steps."""
        self._set_step(iteration)

    def bits_by_group(self) -> Dict[str, int]:
        """Current bits per module group (0 while still in full precision)."""
        return {group: self.bits or 0 for group in self.module_groups()}

    def module_groups(self) -> List[str]:
        """The module groups with a quantized weight (model order; with pipeline stages, any stage's, in
        MODULE_GROUPS order: every rank alike)."""
        return list(self._module_groups)

    def _groups_of_every_stage(self) -> List[str]:
        held = torch.tensor([float(any(t.group == g for t in self.targets)) for g in MODULE_GROUPS])
        self.sum_over_stages(held)
        return [g for g, count in zip(MODULE_GROUPS, held.tolist()) if count > 0]

    # ---- monitoring ------------------------------------------------------------------------------
    @torch.no_grad()
    def quantization_error(self) -> Dict[str, float]:
        """Mean relative error ||w_hat - w|| / ||w|| per module group, over its tensors (each global
        expert counted as one tensor), at the current bits with nearest rounding. Collective over ep (and the
        pipeline: each stage's own weights; tp and etp: each weight's shards)."""
        groups = self.module_groups()
        sums = torch.zeros(2 * len(groups), dtype=torch.float64)  # dense part: identical on every rank
        expert_sums = torch.zeros_like(sums)  # expert part: summed over ep
        if self.bits is not None:
            for t in self.targets:
                ratios = _relative_errors(t, self.bits, self.config, shard_group(t, self.shard_groups))
                target = expert_sums if t.shard is not None else sums
                i = groups.index(t.group)
                target[2 * i] += ratios.sum()
                target[2 * i + 1] += ratios.numel()
        if any(t.shard is not None for t in self.targets):
            comm.all_reduce(expert_sums, self.ep_group)
        total = sums + expert_sums
        if self.sum_over_stages is not None:
            self.sum_over_stages(total)
        return {
            g: float(total[2 * i] / total[2 * i + 1]) if total[2 * i + 1] > 0 else 0.0 for i, g in enumerate(groups)
        }

    def scalars(self) -> Dict[str, float]:
        """TensorBoard scalars: bits and quantization error per module group (collective over ep)."""
        out: Dict[str, float] = {tag("qat_bits", group=g): float(b) for g, b in self.bits_by_group().items()}
        out.update({tag("qat_quant_error", group=g): e for g, e in self.quantization_error().items()})
        return out

    # ---- optimizer and checkpoints --------------------------------------------------------------
    def state_dict(self) -> Dict:
        return {"step": self.step, "bits": self.bits}

    def load_state_dict(self, state: Dict) -> None:
        """Resume the schedule at the saved step (bits follow from the current config)."""
        self._set_step(int(state["step"]))


def shard_group(t: QuantTarget, shard_groups: Tuple[Optional[object], Optional[object]]) -> Optional[object]:
    """The ranks holding the other shards of a target's weight: etp's for an expert stack, else tp's."""
    tp, etp = shard_groups
    return etp if t.shard is not None else tp


def _relative_errors(t: QuantTarget, bits: int, config: QATConfig, group: Optional[object]) -> torch.Tensor:
    """||w_hat - w|| / ||w|| of each unit (the tensor, or each local expert) of one target; collective over
    `group` for a tensor-parallel shard."""
    w = t.parameter().detach()
    shard = t.tensor_shard
    if shard is None:
        w_RN = to_rows(w, t.units, config.groups)
        w_hat = quantize_rows(w_RN, bits, config.symmetric).dequantize()
    else:
        w_hat, w_RN = quantize_shard(w, bits, ShardRows(shard, t.units, config.groups), config.symmetric, group)
    squares_2U = torch.stack(
        [(w_hat - w_RN).view(t.units, -1).double().square().sum(dim=1), w_RN.view(t.units, -1).double().square().sum(1)]
    )
    if shard is not None:
        comm.all_reduce(squares_2U, group)
    err_U, norm_U = squares_2U.sqrt()
    return torch.where(norm_U > 0, err_U / norm_U.clamp(min=1e-30), torch.zeros_like(err_U))


def apply_qat(
    model: nn.Module,
    config: QATConfig,
    groups: Optional[ParallelGroups] = None,
    seed: int = 0,
    sum_over_stages: Optional[Callable[[torch.Tensor], None]] = None,
) -> QATController:
    """Register fake quantization on the selected weights of `model` (before building the optimizer). `model` may
    be a pipeline rank's StageModel (`groups` its stage's, `sum_over_stages` its pipeline's sum: QATController):
    its last stage's copy of the word embedding (tied, or the MTP depths' input) is fake-quantized as the
    embedding is, under the same name (so the same rounding), and is not a target (counted once).

    Raises ConfigError for a module group the model cannot quantize or groups that do not divide
    a tensor; RuntimeError if the parametrization did not keep a Parameter object and its storage.
    """
    groups = groups or ParallelGroups.single()
    targets = quant_targets(model, config.module_groups)
    check_groups_divide(targets, config.groups)
    state = QATState()
    shard_groups = (groups.tp, groups.etp)
    controller = QATController(config, targets, state, groups.ep, sum_over_stages, shard_groups)
    for t in targets:
        _register(t, config, seed, state, shard_group(t, shard_groups))
    copy = getattr(model, "embedding_copy", None)
    if copy is not None and "embedding" in config.module_groups:
        copy_target = QuantTarget("embedding", "embedding.weight", copy, "weight", None)
        _register(copy_target, config, seed, state, groups.tp)
    if config.activation_bits is not None:
        add_activation_quant(targets, config.activation_bits, state)
    return controller


def _register(t: QuantTarget, config: QATConfig, seed: int, state: QATState, group: Optional[object]) -> None:
    param = getattr(t.module, t.attr)
    storage = param.data_ptr()
    stochastic = config.rounding == "stochastic"
    fq = FakeQuantWeight(
        t.name, t.units, config.groups, config.symmetric, stochastic, seed, t.shard, state, t.tensor_shard, group
    )
    parametrize.register_parametrization(t.module, t.attr, fq)
    kept = t.module.parametrizations[t.attr].original
    if kept is not param or kept.data_ptr() != storage:
        raise RuntimeError(
            f"QAT on {t.name}: the parametrization replaced the Parameter or its storage; "
            "the optimizer would train a detached copy"
        )


def add_activation_quant(targets: Sequence[QuantTarget], bits: int, state: QATState) -> None:
    """Per-token fake quantization of the inputs of the quantized linear layers and expert stacks."""
    seen = set()
    for t in targets:
        if t.group not in ACTIVATION_GROUPS or id(t.module) in seen:
            continue
        if isinstance(t.module, (nn.Linear, GroupedExperts)):
            t.module.register_forward_pre_hook(ActivationFakeQuant(bits, state))
            seen.add(id(t.module))
