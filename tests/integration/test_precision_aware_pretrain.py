"""Megatron's precision-aware optimizer flags in the pretraining script: a bf16 run with bf16 moments and main
grads trains like the fp32-moment run (the loss curve), differs from it (the flags act), and resumes from its
checkpoint bit-exactly; the flags' rules are Megatron's, one line each."""

import pytest

from moezero.config import ConfigError
from moezero.training.configs import validate
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs, train

RUN = TINY + ["--train-iters", "20", "--bf16", "--expert-model-parallel-size", "2"]
PRECISION_AWARE = [
    "--use-precision-aware-optimizer",
    "--main-grads-dtype",
    "bf16",
    "--exp-avg-dtype",
    "bf16",
    "--exp-avg-sq-dtype",
    "bf16",
]


def _curves(cache_dir, save_dir):
    fp32_moments = train(RUN, cache_dir)
    narrow = train(RUN + PRECISION_AWARE, cache_dir)
    first = train(RUN + PRECISION_AWARE + ["--exit-interval", "10", "--save", save_dir], cache_dir)
    second = train(RUN + PRECISION_AWARE + ["--load", save_dir], cache_dir)
    losses = lambda history: [h["lm_loss"] for h in history]
    return losses(fp32_moments), losses(narrow), losses(first + second)


def test_bf16_moments_follow_the_fp32_curve_and_resume_exactly(tmp_path):
    fp32_moments, narrow, resumed = run_distributed(_curves, 2, str(tmp_path), str(tmp_path / "ckpt"), timeout=500)[0]
    assert resumed == narrow
    assert narrow != fp32_moments
    assert max(abs(a - b) / b for a, b in zip(narrow, fp32_moments)) < 0.02, (narrow, fp32_moments)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            ["--exp-avg-dtype", "bf16"],
            "--exp-avg-dtype='bf16': can only be fp32 without --use-precision-aware-optimizer",
        ),
        (["--main-params-dtype", "fp16"], "--main-params-dtype='fp16': can only be fp32 without --use-precision-aware"),
        (
            ["--use-precision-aware-optimizer", "--optimizer", "sgd"],
            "--use-precision-aware-optimizer: only with --optimizer adam",
        ),
        (["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"], "--main-grads-dtype bf16: needs --bf16"),
    ],
)
def test_megatron_rules_are_one_line(extra, needle):
    with pytest.raises(ConfigError) as info:
        validate(configs(TINY + extra), 1)
    assert needle in str(info.value)
