"""Hugging Face MoE checkpoints in and out, of the families families.py lists.

    model = moezero.hf.from_pretrained("path/to/Qwen3-30B-A3B", dtype=torch.bfloat16, groups=groups)
    moezero.hf.save_pretrained(model, "out/", groups=groups)

Needs safetensors only; transformers is the test oracle.
"""

from moezero.hf.families import FAMILIES, UnsupportedModel
from moezero.hf.load import CheckpointMismatch, ParamsNotRead, from_pretrained, load_hub_weights, run_configs
from moezero.hf.save import save_pretrained

__all__ = [
    "FAMILIES",
    "CheckpointMismatch",
    "ParamsNotRead",
    "UnsupportedModel",
    "from_pretrained",
    "load_hub_weights",
    "run_configs",
    "save_pretrained",
]
