"""Loss and perplexity of the fp, fake-quantized and exported models on one evaluation set.

The three rows of the comparison: the checkpoint's fp model (fp32 masters), the same weights
fake-quantized as the QAT forward does it, and the exported file (packed integers, dequantized).
Any world size and ep; every rank gets the same numbers.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

from moezero.compression.description import ModelDescription
from moezero.compression.evaluation import eval_dataset, lm_loss
from moezero.compression.inference import load_checkpoint_weights, load_quantized_model, read_exported
from moezero.compression.source import load_checkpoint_model
from moezero.config import DataConfig
from moezero.parallel import ParallelGroups


def evaluate_models(
    data: DataConfig,
    seed: int,
    num_samples: int,
    micro_batch_size: int,
    quantized: Optional[str] = None,
    checkpoint: Optional[str] = None,
    groups: Optional[ParallelGroups] = None,
) -> Dict[str, float]:
    """{"fp": loss, "fake_quant": loss, "quantized": loss}, each present when its source is given
    (fake_quant needs both: the checkpoint's weights with the export's quantization)."""
    groups = groups or ParallelGroups.single()
    blob = read_exported(quantized) if quantized else None
    source = load_checkpoint_model(checkpoint) if checkpoint else None
    description = ModelDescription.from_dict(blob["description"]) if blob else source.description
    dataset = eval_dataset(data, description.gpt_config().seq_length, seed, num_samples)
    dataset.vocab_limit = description.gpt_config().vocab_size  # another tokenizer's ids: one line, not an IndexError
    losses: Dict[str, float] = {}

    def run(model) -> float:
        return lm_loss(model, dataset, num_samples, micro_batch_size, groups)

    if source is not None:
        losses["fp"] = run(load_checkpoint_weights(source, groups))
    if blob is not None:
        model, spec = load_quantized_model(blob, groups)
        losses["quantized"] = run(model)
        if source is not None:
            losses["fake_quant"] = run(load_checkpoint_weights(source, groups, fake_quant=spec))
    return losses


def format_report(losses: Dict[str, float], bits: Optional[int] = None) -> str:
    names = {
        "fp": "fp model (checkpoint fp32 masters)",
        "fake_quant": f"fake-quant model ({bits}-bit, as in QAT forward)",
        "quantized": f"exported model ({bits}-bit packed, dequantized)",
    }
    lines = []
    for key in ("fp", "fake_quant", "quantized"):
        if key in losses:
            loss = losses[key]
            lines.append(f" {names[key]:<48} | lm loss: {loss:.6f} | PPL: {math.exp(min(loss, 20.0)):.4f}")
    return "\n".join(lines)
