"""Pretraining runs on one GPU, for test_gpu_pretrain.py: a world of one over NCCL, as
`python examples_moe/pretrain_gpt_moe.py` joins on a CUDA machine. Writes every run's curve as JSON.

    python -m tests.integration.gpu_runs CACHE_DIR SAVE_DIR OUT_JSON
"""

import json
import sys

import torch
import torch.distributed as dist

from moezero.recipe import pretraining
from moezero.training.job import init_distributed
from tests.integration.pretrain_utils import TINY, configs
from tests.integration.test_pretrain import FP64

ITERS = ["--train-iters", "10"]
# dropout and jitter drawn on the GPU are the GPU's numbers (moezero/keyed_random.py): the runs compared with the
# CPU draw none; the keyed runs compare GPU layouts with each other
_JITTER = TINY.index("--moe-input-jitter-eps")
PLAIN_TINY = TINY[:_JITTER] + TINY[_JITTER + 2 :] + ["--hidden-dropout", "0", "--attention-dropout", "0"]
KEYED = {
    "stage 0": ["--zero-stage", "0"],
    "stage 3": ["--zero-stage", "3"],
    "stage 2 recompute": ["--zero-stage", "2", "--recompute-activations"],
}
PRECISION_AWARE = [
    "--bf16",
    "--use-precision-aware-optimizer",
    "--main-grads-dtype",
    "bf16",
    "--exp-avg-dtype",
    "bf16",
    "--exp-avg-sq-dtype",
    "bf16",
]


def train_on_gpu(argv, cache_dir):
    """One run's per-iteration history, the device type of every param and the peak CUDA allocation."""
    torch.cuda.reset_peak_memory_stats()
    run = pretraining(configs(argv + ["--data-cache-path", cache_dir]))
    run.train()
    devices = sorted({p.device.type for p in run.model.parameters()})
    run.groups.destroy()
    peak_mb = torch.cuda.max_memory_allocated() / 2**20
    return {"history": run.history, "devices": devices, "cuda_max_allocated_mb": peak_mb}


def main(cache_dir: str, save_dir: str, out_path: str) -> None:
    init_distributed("nccl", 5)
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    plain = PLAIN_TINY + ITERS
    runs = {
        f"fp64 stage {stage}": train_on_gpu(plain + FP64 + ["--zero-stage", str(stage)], cache_dir)
        for stage in (0, 2, 3)
    }
    runs.update(
        {f"fp64 keyed {name}": train_on_gpu(TINY + ITERS + FP64 + flags, cache_dir) for name, flags in KEYED.items()}
    )
    runs["fp32"] = train_on_gpu(plain, cache_dir)
    runs["bf16"] = train_on_gpu(plain + ["--bf16"], cache_dir)
    runs["fp64 first half, saved"] = train_on_gpu(
        plain + FP64 + ["--exit-interval", "5", "--save", save_dir], cache_dir
    )
    runs["fp64 second half, loaded"] = train_on_gpu(plain + FP64 + ["--load", save_dir], cache_dir)
    runs["precision-aware"] = train_on_gpu(plain + PRECISION_AWARE, cache_dir)
    halves = plain + PRECISION_AWARE
    runs["precision-aware first half, saved"] = train_on_gpu(
        halves + ["--exit-interval", "5", "--save", save_dir + "_pa"], cache_dir
    )
    runs["precision-aware second half, loaded"] = train_on_gpu(halves + ["--load", save_dir + "_pa"], cache_dir)
    runs["device"] = torch.cuda.get_device_name()
    with open(out_path, "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
