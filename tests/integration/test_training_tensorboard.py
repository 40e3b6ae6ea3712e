"""TensorBoard holds the series of what the run has, once per step: no 'z loss' / 'aux loss' without their
coefficients (megatron-core's router tracks a z loss only with --moe-z-loss-coeff, an aux loss only with a
coefficient above 0), and one 'lm loss validation' point at the last iteration where the interval's validation
falls on it (Megatron writes the validation after training there too: a second point at the same step)."""

from tests.integration.pretrain_utils import TINY, configs


def _without(argv, *flags):
    out = list(argv)
    for flag in flags:
        at = out.index(flag)
        del out[at : at + 2]
    return out


def test_only_the_runs_losses_and_one_validation_point_per_step(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moezero.recipe import pretraining

    tb = str(tmp_path / "tb")
    argv = _without(TINY, "--moe-z-loss-coeff", "--moe-aux-loss-coeff") + [
        "--train-iters",
        "4",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--tensorboard-dir",
        tb,
        "--data-cache-path",
        str(tmp_path),
    ]
    run = pretraining(configs(argv))
    run.train()
    run.groups.destroy()
    out = capsys.readouterr().out
    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert not {"z loss", "aux loss", "z_loss", "load_balancing_loss"} & tags, sorted(tags)
    assert "lm loss" in tags
    assert [e.step for e in events.Scalars("lm loss validation")] == [2, 4]
    assert [e.step for e in events.Scalars("lm loss validation vs samples")] == [16, 32]
    # the console keeps Megatron's two lines at the last iteration: the interval's and the one after training
    assert (
        out.count("validation loss at iteration 4 |") == 1
        and out.count("validation loss at iteration 4 on validation set |") == 1
    ), out
