"""Test areas, as pytest markers: `pytest -m zero` (or moe, hf, megatron, data, checkpoint, ops, qat, training, docs)
runs one area. A test file's areas come from its name (its folder for ops); conftest.py marks every test."""

from pathlib import PurePath
from typing import List

AREAS = {  # area: what it covers, words of the file names that belong to it
    "zero": (
        "the ZeRO optimizer: buckets, stages 0-3, agreement, master weights",
        (
            "zero",
            "partition",
            "muon",
            "rank_disagreement",
            "batch_agreement",
            "local_channel",
            "local_exchange",
            "precision_aware",
            "model_copies",
            "add_widened",
            "groups_and_comm",
            "harness",
            "frozen",
            "optimizer_choices",
            "loss_scaler",
        ),
    ),
    "moe": (
        "the MoE layer: routing, dispatch, experts, load balancing, upcycling",
        ("moe", "expert", "load_balancing", "upcycling", "wgrad", "phases"),
    ),
    "hf": ("Hugging Face checkpoints and configs", ("hf",)),
    "megatron": ("Megatron flags, scripts and megatron-core oracles", ("megatron",)),
    "data": ("datasets, tokenizers and loaders", ("data", "tokenizer", "batch_schedule", "corpus")),
    "checkpoint": (
        "checkpoints, preemption and faults",
        ("checkpoint", "preemption", "faults", "async_save", "resume", "strided_pieces"),
    ),
    "ops": ("the C++/CUDA kernels", ("ops/", "gelu")),
    "qat": ("quantization-aware training", ("qat",)),
    "training": (
        "the model and the training loop",
        (
            "pretrain",
            "training",
            "lr_schedule",
            "config",
            "throughput",
            "generate",
            "sampling",
            "attention",
            "gpt_oracle",
            "architecture",
            "host_memory",
            "rank_layout",
            "mtp",
            "expert_shapes",
            "keyed_random",
            "job_init",
            "profiling",
            "pipeline",
            "context_parallel",
            "tp_regions",
            "tensor_marker",
            "tensor_parallel",
            "tp_model",
        ),
    ),
    "docs": ("the README and the docs site: the build, its links and every command shown", ("docs",)),
}


def areas_of(path: str) -> List[str]:
    """The areas of the test file at `path` (relative to the repository or absolute)."""
    parts = PurePath(path).parts
    name = "/".join(parts[parts.index("tests") + 1 :]) if "tests" in parts else PurePath(path).name
    return [area for area, (_, words) in AREAS.items() if any(word in name for word in words)]
