"""Every metric moezero reports, named once: its console label and format, and its TensorBoard tag.

Producers hand values keyed by the names below (`lm_loss`, ...); the console line and the TensorBoard
writer look the names up here. Adding a metric is one line in this table (plus producing its value).
Tags with {fields} are families (one scalar per MoE layer, expert or QAT module group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional


@dataclass(frozen=True)
class Metric:
    console: Optional[str]  # label on the console line (None: TensorBoard only)
    tensorboard: Optional[str]  # TensorBoard tag, may name {fields} (None: console only)
    fmt: str = ""  # format spec of the console value ("d" ones are printed as integers)
    vs_samples: bool = False  # also '<tag> vs samples', over consumed samples (Megatron's second series)


METRICS: Dict[str, Metric] = {
    # the training line, in console order: Megatron's labels, formats and tags where Megatron logs the same
    # (its training_log), then moezero's own fields
    "consumed_samples": Metric("consumed samples", "consumed-samples", ">12d"),
    "step_time_ms": Metric("elapsed time per iteration (ms)", None, ".1f"),
    "iteration_time": Metric(None, "iteration-time"),  # seconds, as Megatron's
    "throughput": Metric("throughput per GPU (TFLOP/s/GPU)", "throughput", ".1f"),  # per rank, GPU or not
    "lr": Metric("learning rate", "learning-rate", ".6E", vs_samples=True),
    "global_batch_size": Metric("global batch size", "batch-size", ">5d", vs_samples=True),
    "lm_loss": Metric("lm loss", "lm loss", ".6E", vs_samples=True),
    # MoE losses without their coefficients, the mean over MoE layers, as Megatron's tracker names them
    "load_balancing_loss": Metric("load_balancing_loss", "load_balancing_loss", ".6E"),
    "seq_load_balancing_loss": Metric("seq_load_balancing_loss", "seq_load_balancing_loss", ".6E"),
    "global_load_balancing_loss": Metric("global_load_balancing_loss", "global_load_balancing_loss", ".6E"),
    "z_loss": Metric("z_loss", "z_loss", ".6E"),
    # multi-token prediction: each depth's loss without the scaling factor, as Megatron's MTPLossLoggingHelper
    # (depths past the fourth are added by mtp_loss_metric)
    **{f"mtp_{k}_loss": Metric(f"mtp_{k} loss", f"mtp_{k} loss", ".6E") for k in range(1, 5)},
    "router_aux_loss": Metric(None, "aux loss"),  # moezero's: with their coefficients, summed over MoE layers
    "router_z_loss": Metric(None, "z loss"),
    "loss_scale": Metric("loss scale", "loss-scale", ".1f", vs_samples=True),
    "world_size": Metric(None, "world-size", vs_samples=True),  # --log-world-size-to-tensorboard
    "grad_norm": Metric("grad norm", "grad-norm", ".3f", vs_samples=True),
    "num_zeros": Metric("num zeros", "num-zeros", "d", vs_samples=True),
    "params_norm": Metric("params norm", "params-norm", ".3f", vs_samples=True),
    "skipped_iterations": Metric("number of skipped iterations", None, ">3d"),  # in the line's interval
    "nan_iterations": Metric("number of nan iterations", None, ">3d"),
    "tokens_per_s": Metric("tokens/s", "tokens-per-sec", ".0f"),
    "max_rss_mb": Metric("max rss (MB)", "memory/max-rss-mb", ".0f"),
    "cuda_max_allocated_mb": Metric("max allocated (MB)", "memory/max-allocated-mb", ".0f"),
    "zero_held_mb": Metric("zero held (MB)", "memory/zero-held-mb", ".1f"),
    # --log-memory-to-tensorboard on a GPU: Megatron's tags, from torch.cuda.memory_stats()
    "mem_reserved_bytes": Metric(None, "mem-reserved-bytes"),
    "mem_allocated_bytes": Metric(None, "mem-allocated-bytes"),
    "mem_max_allocated_bytes": Metric(None, "mem-max-allocated-bytes"),
    "mem_allocated_count": Metric(None, "mem-allocated-count"),
    "moe_max_mean_load": Metric("moe max/mean load", "moe/max-mean-load-ratio", ".2f"),
    # with --moe-per-layer-logging each MoE layer's loss (loss: a Megatron tracker name)
    "moe_layer_loss": Metric(None, "moe/{loss}_layer_{layer}"),
    # per MoE layer
    "max_mean_load_ratio": Metric(None, "moe/layer{layer}/max-mean-load-ratio"),
    "dropped_fraction": Metric(None, "moe/layer{layer}/dropped-fraction"),
    "tokens_per_expert": Metric(None, "moe/layer{layer}/tokens-per-expert/{expert}"),
    # evaluation
    "validation_loss": Metric("lm loss value", "lm loss validation", ".6E", vs_samples=True),
    "validation_ppl": Metric("lm loss PPL", "lm loss validation ppl", ".6E", vs_samples=True),
    "test_loss": Metric("lm loss value", "test/lm loss", ".6E"),
    "test_ppl": Metric("lm loss PPL", "test/lm loss ppl", ".6E"),
    # quantization-aware training, per module group
    "qat_bits": Metric(None, "qat/bits/{group}"),
    "qat_quant_error": Metric(None, "qat/quant-error/{group}"),
}


def mtp_loss_metric(depth: int) -> str:
    """The metric name of MTP depth `depth` (1-based), declared here if the table lacks it."""
    name = f"mtp_{depth}_loss"
    METRICS.setdefault(name, Metric(f"mtp_{depth} loss", f"mtp_{depth} loss", ".6E"))
    return name


def tag(name: str, **fields) -> str:
    """The TensorBoard tag of metric `name` (KeyError for a metric the table does not name)."""
    return METRICS[name].tensorboard.format(**fields)


def tensorboard_scalars(values: Mapping[str, float]) -> Dict[str, float]:
    """{tag: value} of the metrics in `values` that go to TensorBoard."""
    _check_named(values)
    return {tag(name): value for name, value in values.items() if METRICS[name].tensorboard is not None}


def vs_samples_scalars(values: Mapping[str, float]) -> Dict[str, float]:
    """{'<tag> vs samples': value} of the metrics in `values` Megatron also plots over consumed samples."""
    _check_named(values)
    return {f"{tag(name)} vs samples": value for name, value in values.items() if METRICS[name].vs_samples}


def console_fields(values: Mapping[str, float]) -> List[str]:
    """'label: value' of the console metrics in `values`, in the table's order."""
    _check_named(values)
    out = []
    for name, metric in METRICS.items():
        if name in values and metric.console is not None:
            value = int(values[name]) if metric.fmt.endswith("d") else values[name]
            out.append(f"{metric.console}: {value:{metric.fmt}}")
    return out


def _check_named(values: Mapping[str, float]) -> None:
    unnamed = set(values) - set(METRICS)
    if unnamed:
        raise KeyError(f"metrics missing from moezero.metrics.METRICS: {sorted(unnamed)}")
