"""--optimizer muon in the pretraining script: a tiny GPT-MoE (ep 2 on 2 ranks) trains, its loss falls, and its
checkpoint (Muon's momentum buffers with the Adam moments) resumes to the uninterrupted run's losses, bit for bit;
bad Muon values are refused in one line each."""

import pytest

from moezero.config import ConfigError
from moezero.training.configs import validate
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs, train

RUN = TINY + ["--train-iters", "8", "--expert-model-parallel-size", "2", "--optimizer", "muon", "--muon-nesterov"]


def _curves(cache_dir, save_dir):
    whole = train(RUN, cache_dir)
    first = train(RUN + ["--exit-interval", "4", "--save", save_dir], cache_dir)
    second = train(RUN + ["--load", save_dir], cache_dir)
    losses = lambda history: [h["lm_loss"] for h in history]
    return losses(whole), losses(first + second)


def test_muon_trains_and_resumes_exactly(tmp_path):
    whole, resumed = run_distributed(_curves, 2, str(tmp_path), str(tmp_path / "ckpt"), timeout=500)[0]
    assert resumed == whole
    assert whole[-1] < whole[0], whole


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--muon-momentum", "1.0"], "--muon-momentum 1.0: it must lie in [0, 1)"),
        (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps 0: at least 1"),
        (["--muon-coefficient-type", "cubic"], "--muon-coefficient-type 'cubic': choose one of simple, quintic"),
        (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec 'low': choose medium or high"),
        (["--muon-scalar-optimizer", "lion"], "--muon-scalar-optimizer lion: not supported"),
        (["--optimizer", "muon", "--fp16"], "--optimizer muon: not with --fp16"),
    ],
)
def test_bad_muon_values_are_one_line(extra, needle):
    with pytest.raises(ConfigError) as info:
        validate(configs(TINY + extra), 1)
    assert needle in str(info.value) and "\n" not in str(info.value)
