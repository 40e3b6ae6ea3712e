"""Pretraining on a GPU equals pretraining on the CPU: one process over NCCL (tests/integration/gpu_runs.py)
against the same runs in this process on the CPU. Runs only on a GPU machine (tools/gpu_check.sh).

The initial weights are keyed and drawn on the CPU (moezero/keyed_random.py); dropout and jitter, drawn on the
GPU, are off in the runs compared with the CPU, so their curves differ only by the devices' summation orders:
float64 to 1e-10 as between layouts, fp32 to test_pretrain's FP32_BOUND. With them on, GPU layouts agree."""

import json
import os
import subprocess
import sys

import pytest

from tests.integration.gpu_runs import FP64, ITERS, KEYED, PLAIN_TINY, PRECISION_AWARE
from tests.integration.pretrain_utils import train
from tests.integration.test_pretrain import FP32_BOUND, _worst as worst

pytestmark = pytest.mark.gpu
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    """The GPU runs' curves (one subprocess, so this process's CPU runs never see a process group)."""
    tmp = tmp_path_factory.mktemp("gpu")
    out = tmp / "runs.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.gpu_runs", str(tmp / "cache"), str(tmp / "ckpt"), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out) as f:
        runs = json.load(f)
    print(f"GPU runs on {runs.pop('device')}")
    return {"runs": runs, "cache": str(tmp / "cache"), "ckpt": str(tmp / "ckpt")}


def losses(run):
    return [h["lm_loss"] for h in run["history"]]


def test_every_run_trained_on_the_gpu(gpu):
    for name, run in gpu["runs"].items():
        assert run["devices"] == ["cuda"] and run["cuda_max_allocated_mb"] > 0, (name, run["devices"])


def test_float64_curves_equal_the_cpu_at_every_stage(gpu):
    cpu = losses({"history": train(PLAIN_TINY + ITERS + FP64, gpu["cache"])})
    assert cpu[-1] < cpu[0] - 0.2, "the loss must fall"
    for stage in (0, 2, 3):
        gpu_curve = losses(gpu["runs"][f"fp64 stage {stage}"])
        print(f"fp64 stage {stage}: worst relative difference {worst(gpu_curve, cpu):.2e}")
        assert worst(gpu_curve, cpu) < 1e-10, (stage, gpu_curve, cpu)


def test_gpu_drawn_dropout_and_jitter_agree_across_layouts(gpu):
    """Masks and jitter drawn on the GPU, keyed by sample: stage 0, stage 3 and a recomputed forward (which draws
    them again) give one curve, and it is not the curve without them."""
    runs = gpu["runs"]
    keyed = {name: losses(runs[f"fp64 keyed {name}"]) for name in KEYED}
    for name, curve in keyed.items():
        print(f"keyed {name}: worst relative difference {worst(curve, keyed['stage 0']):.2e}")
        assert worst(curve, keyed["stage 0"]) < 1e-10, (name, curve, keyed["stage 0"])
    assert worst(keyed["stage 0"], losses(runs["fp64 stage 0"])) > 1e-4


def test_fp32_and_bf16_curves_follow_the_cpu(gpu):
    for name, extra, bound in (
        ("fp32", [], FP32_BOUND),
        ("bf16", ["--bf16"], 3e-2),
        ("precision-aware", PRECISION_AWARE, 3e-2),
    ):
        cpu = losses({"history": train(PLAIN_TINY + ITERS + extra, gpu["cache"])})
        gpu_curve = losses(gpu["runs"][name])
        print(f"{name}: worst relative difference {worst(gpu_curve, cpu):.2e}")
        assert worst(gpu_curve, cpu) < bound, (name, gpu_curve, cpu)


def test_a_gpu_checkpoint_resumes_on_the_gpu_and_on_the_cpu(gpu):
    runs = gpu["runs"]
    first, second = runs["fp64 first half, saved"]["history"], runs["fp64 second half, loaded"]["history"]
    assert [h["iteration"] for h in first + second] == list(range(1, 11))
    cpu_second = train(PLAIN_TINY + ITERS + FP64 + ["--load", gpu["ckpt"]], gpu["cache"])
    assert [h["iteration"] for h in cpu_second] == list(range(6, 11))
    cpu_straight = losses({"history": train(PLAIN_TINY + ITERS + FP64, gpu["cache"])})
    assert worst(losses({"history": first + second}), cpu_straight) < 1e-10
    assert worst(losses({"history": first + cpu_second}), cpu_straight) < 1e-10


def test_a_precision_aware_run_resumes_on_the_gpu(gpu):
    """The precision-aware optimizer's packed state (bf16 moments, the step its fused kernel reads on the GPU)."""
    runs = gpu["runs"]
    first = runs["precision-aware first half, saved"]["history"]
    second = runs["precision-aware second half, loaded"]["history"]
    assert [h["iteration"] for h in first + second] == list(range(1, 11))
    resumed, straight = losses({"history": first + second}), losses(runs["precision-aware"])
    print(f"precision-aware resumed: worst relative difference {worst(resumed, straight):.2e}")
    assert worst(resumed, straight) < 1e-2
