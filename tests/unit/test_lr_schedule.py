"""The learning-rate schedule against megatron-core's own OptimizerParamScheduler, driven as Megatron's training
loop drives it (built at num_steps 0, stepped by each successful step's samples), over warmup, decay and the
tail of every decay style; and what a resume does with a changed schedule (Megatron's _check_and_set)."""

import logging
import types

import pytest

from moezero.config import ConfigError
from moezero.training.configs import TrainConfig
from moezero.training.lr_schedule import LearningRateSchedule, resumed_schedule

optimizer_param_scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")


def megatron_scheduler(t: TrainConfig, **kwargs):
    """Megatron's scheduler for the run `t` (training.py's get_optimizer_param_scheduler, iteration-based)."""
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    optimizer = types.SimpleNamespace(param_groups=[{}])
    gbs = t.global_batch_size
    decay = (t.lr_decay_iters or t.train_iters) * gbs
    warmup = t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None else t.lr_warmup_iters * gbs
    wsd = t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters is not None else None
    kwargs = {"use_checkpoint_opt_param_scheduler": False, **kwargs}  # the parser's default, not the class's
    return optimizer_param_scheduler.OptimizerParamScheduler(
        optimizer,
        init_lr=t.lr_warmup_init,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=t.lr_decay_style,
        start_wd=_or(t.start_weight_decay, t.weight_decay),
        end_wd=_or(t.end_weight_decay, t.weight_decay),
        wd_incr_steps=t.train_iters * gbs,
        wd_incr_style=t.weight_decay_incr_style,
        wsd_decay_steps=wsd,
        lr_wsd_decay_style=t.lr_wsd_decay_style,
        **kwargs,
    ), optimizer


def _or(value, default):
    return default if value is None else value


STYLES = [dict(lr_decay_style=s) for s in ("constant", "linear", "cosine", "inverse-square-root")] + [
    dict(lr_decay_style="WSD", lr_wsd_decay_style=w, lr_wsd_decay_iters=6)
    for w in ("exponential", "linear", "cosine", "minus_sqrt")
]


@pytest.mark.parametrize("style", STYLES, ids=lambda s: s.get("lr_wsd_decay_style", s["lr_decay_style"]))
@pytest.mark.parametrize(
    "warmup",
    [dict(lr_warmup_iters=5, lr_warmup_init=1e-4), dict(lr_warmup_fraction=0.25), dict()],
    ids=["iters+init", "fraction", "none"],
)
def test_every_step_runs_megatrons_lr(style, warmup):
    """30 steps of a 24-step decay (the tail at min_lr), one skipped step (no advance, as Megatron)."""
    t = TrainConfig(lr=3e-3, min_lr=3e-4, train_iters=30, lr_decay_iters=24, global_batch_size=8, **style, **warmup)
    theirs, optimizer = megatron_scheduler(t)
    ours, num_steps = LearningRateSchedule.from_config(t), 0
    for step in range(t.train_iters):
        assert ours.lr(num_steps) == optimizer.param_groups[0]["lr"], (step, num_steps)
        if step != 7:  # a skipped step advances neither
            theirs.step(increment=t.global_batch_size)
            num_steps += t.global_batch_size


@pytest.mark.parametrize("style", ["linear", "cosine", "constant"])
def test_every_step_runs_megatrons_weight_decay(style):
    """--weight-decay-incr-style: each step's weight decay is Megatron's get_wd (from --start-weight-decay to
    --end-weight-decay over the run's samples), a skipped step advancing neither."""
    ends = dict(start_weight_decay=0.0, end_weight_decay=0.1) if style != "constant" else dict(weight_decay=0.05)
    t = TrainConfig(lr=3e-3, train_iters=20, global_batch_size=8, weight_decay_incr_style=style, **ends)
    theirs, optimizer = megatron_scheduler(t)
    ours, num_steps = LearningRateSchedule.from_config(t), 0
    for step in range(t.train_iters):
        assert ours.weight_decay_at(num_steps) == pytest.approx(
            optimizer.param_groups[0]["weight_decay"], rel=1e-12, abs=1e-15
        ), (step, num_steps)
        if step != 5:
            theirs.step(increment=t.global_batch_size)
            num_steps += t.global_batch_size
    assert ours.weight_decay_at(t.train_iters * 8 + 1) == pytest.approx(0.1 if style != "constant" else 0.05)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(start_weight_decay=0.0), "--start-weight-decay=0.0: only with --weight-decay-incr-style linear"),
        (dict(weight_decay_incr_style="linear", start_weight_decay=0.0), "--end-weight-decay=None: a value >= 0"),
    ],
)
def test_a_weight_decay_increment_takes_megatrons_flags(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        TrainConfig(global_batch_size=8, **kwargs)


def test_a_run_applies_the_weight_decay_increment_to_its_decayed_params(tmp_path):
    """The run sets each step's weight decay on its groups: the decayed params' from the increment (here after 2
    steps of 8 samples each of a 16-sample run: 0.1 * 8 / 16 when the second step ran), none for biases/norms."""
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import TINY, configs

    run = pretraining(
        configs(
            TINY
            + [
                "--train-iters",
                "2",
                "--weight-decay-incr-style",
                "linear",
                "--start-weight-decay",
                "0",
                "--end-weight-decay",
                "0.1",
                "--data-cache-path",
                str(tmp_path),
            ]
        )
    )
    run.train()
    run.groups.destroy()
    assert sorted(g["weight_decay"] for g in run.opt.param_groups) == pytest.approx([0.0, 0.05])


def test_a_resume_compares_the_weight_decay_increment_as_megatron_does():
    """Megatron's scheduler checks start/end weight decay, the increment's style and length on load."""
    base = dict(
        lr=3e-3,
        train_iters=30,
        global_batch_size=8,
        weight_decay_incr_style="linear",
        start_weight_decay=0.0,
        end_weight_decay=0.1,
    )
    for change in (
        dict(end_weight_decay=0.2),
        dict(weight_decay_incr_style="cosine"),
        dict(train_iters=40, lr_decay_iters=30),
    ):
        assert _resume(TrainConfig(**base), TrainConfig(**{**base, **change})) == ("refused", "refused"), change
    ours, megatron = _resume(TrainConfig(**base), TrainConfig(**base))
    assert ours == megatron != "refused"
    saved = LearningRateSchedule.from_config(TrainConfig(**base))
    with pytest.raises(ConfigError, match="--start-weight-decay: 0 in the checkpoint, 0.05 now"):
        resumed_schedule(
            LearningRateSchedule.from_config(TrainConfig(**{**base, "start_weight_decay": 0.05})),
            saved.state(80),
            False,
            False,
        )
    with pytest.raises(ConfigError, match="--end-weight-decay=0.1: must be >= --start-weight-decay"):
        TrainConfig(**{**base, "start_weight_decay": 0.2})


def test_the_first_step_runs_at_the_warmup_init_and_the_warmup_ends_at_lr():
    schedule = LearningRateSchedule.from_config(
        TrainConfig(lr=1.0, lr_warmup_iters=4, global_batch_size=2, lr_warmup_init=0.2, lr_decay_style="constant")
    )
    assert [schedule.lr(2 * i) for i in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_sample_based_lengths_are_megatrons():
    t = TrainConfig(
        train_samples=800,
        global_batch_size=8,
        lr_warmup_samples=80,
        lr_decay_samples=640,
        lr_decay_style="WSD",
        lr_wsd_decay_samples=100,
    )
    assert LearningRateSchedule.from_config(t) == LearningRateSchedule(
        0.0, t.lr, 0.0, 80, 640, "WSD", 100, "exponential", t.weight_decay
    )


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(lr_warmup_iters=200), "--lr-warmup-iters=200: the warmup (3200 samples) must end before"),
        (dict(lr_warmup_fraction=1.0), "--lr-warmup-fraction=1.0: the warmup (3200 samples) must end before"),
        (dict(lr_decay_style="WSD"), "--lr-wsd-decay-iters=None: --lr-decay-style WSD needs"),
        (dict(lr_warmup_init=1.0, lr=0.1), "--lr-warmup-init=1.0: must be <= --lr"),
        (
            dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True),
            "--override-opt_param-scheduler=True: give it or --use-checkpoint-opt_param-scheduler",
        ),
    ],
)
def test_what_megatrons_scheduler_asserts_is_one_line(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(global_batch_size=16, **kwargs)


def _resume(saved_config, new_config, **flags):
    """moezero's and Megatron's answer to resuming `saved_config`'s schedule at step 10 with `new_config`."""
    saved, new = (LearningRateSchedule.from_config(c) for c in (saved_config, new_config))
    theirs, optimizer = megatron_scheduler(new_config, **flags)
    state, _ = megatron_scheduler(saved_config)
    state.step(10 * saved_config.global_batch_size)
    try:
        theirs.load_state_dict(state.state_dict())
        megatron = optimizer.param_groups[0]["lr"]
    except AssertionError:
        megatron = "refused"
    try:
        schedule = resumed_schedule(
            new,
            saved.state(10 * saved_config.global_batch_size),
            flags.get("override_opt_param_scheduler", False),
            flags.get("use_checkpoint_opt_param_scheduler", False),
        )
        ours = schedule.lr(10 * saved_config.global_batch_size)
    except ConfigError as exc:
        ours = "refused"
        assert "--override-opt_param-scheduler" in str(exc) and "in the checkpoint" in str(exc)
    return ours, megatron


@pytest.mark.parametrize(
    "change",
    [
        dict(lr=1e-3),
        dict(min_lr=1e-5),
        dict(lr_warmup_iters=2),
        dict(train_iters=40),
        dict(lr_decay_style="cosine"),
        dict(),
    ],
)
@pytest.mark.parametrize(
    "flags",
    [dict(), dict(override_opt_param_scheduler=True), dict(use_checkpoint_opt_param_scheduler=True)],
    ids=["none", "override", "ckpt"],
)
def test_a_changed_schedule_on_resume_is_decided_as_megatron_does(change, flags):
    base = dict(lr=3e-3, min_lr=1e-4, train_iters=30, global_batch_size=8, lr_warmup_iters=4)
    ours, megatron = _resume(TrainConfig(**base), TrainConfig(**{**base, **change}), **flags)
    assert ours == megatron
    assert (ours == "refused") == (bool(change) and not flags)


def test_a_refusal_names_every_difference():
    saved = LearningRateSchedule.from_config(TrainConfig(lr=3e-3, train_iters=30, global_batch_size=16))
    with pytest.raises(ConfigError) as exc:
        resumed_schedule(
            LearningRateSchedule.from_config(TrainConfig(lr=1e-3, train_iters=40, global_batch_size=16)),
            saved.state(80),
            False,
            False,
        )
    assert "--lr: 0.003 in the checkpoint, 0.001 now" in str(exc.value)
    assert "the decay length (--lr-decay-*, --train-iters / --train-samples): 480 in the checkpoint, 640 now" in str(
        exc.value
    )


def test_param_groups_are_megatrons_weight_decay_and_decoupled_lr(tmp_path):
    """megatron-core's get_standard_config_overrides decides each param's weight decay (none for biases and
    1-D params; embedding tables decayed) and, with --decoupled-lr, which params take the embedding and output
    layer's own max_lr / min_lr; every step's lr of those groups is its scheduler's with that override."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    from moezero.parallel import is_expert_parallel
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import TINY, configs

    run = pretraining(
        configs(
            TINY
            + [
                "--untie-embeddings-and-output-weights",
                "--weight-decay",
                "0.1",
                "--decoupled-lr",
                "1e-2",
                "--decoupled-min-lr",
                "1e-4",
                "--data-cache-path",
                str(tmp_path),
            ]
        )
    )
    model = run.model
    model.embedding.weight.is_embedding_or_output_parameter = True  # as megatron-core's LanguageModule marks them
    model.output.weight.is_embedding_or_output_parameter = True
    overrides = get_standard_config_overrides(OptimizerConfig(lr=3e-3, decoupled_lr=1e-2, decoupled_min_lr=1e-4))
    group_of = {id(p): g for g in run.opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        theirs = {}
        # megatron-core's experts are separate tensors: its rule sees one expert's (a stacked bias's row is 1-D)
        one = p[0] if is_expert_parallel(p) else p
        for key, override in overrides.items():
            if key.matches(one, name):
                theirs.update(override)
        group = group_of[id(p)]
        assert group["weight_decay"] == 0.1 * theirs.get("wd_mult", 1.0), name
        assert (group.get("max_lr"), group.get("min_lr")) == (theirs.get("max_lr"), theirs.get("min_lr")), name
    assert "embedding.weight" not in {n for n, p in model.named_parameters() if group_of[id(p)]["weight_decay"] == 0}
    theirs, optimizer = megatron_scheduler(run.cfg.train)
    optimizer.param_groups = [{"max_lr": 1e-2, "min_lr": 1e-4}, {}]
    theirs.step(0)
    for step in range(12):
        ours = run.lr_schedule
        assert ours.lr(8 * step, 1e-2, 1e-4) == optimizer.param_groups[0]["lr"], step
        assert ours.lr(8 * step) == optimizer.param_groups[1]["lr"], step
        theirs.step(increment=8)
    run.groups.destroy()


def test_a_changed_decoupled_lr_on_resume_is_compared_like_lr():
    """The checkpoint's groups bring back their max_lr / min_lr (Megatron's too); the schedule decides them: a
    changed --decoupled-lr / --decoupled-min-lr is refused in one line, taken with --override-opt_param-scheduler
    and left with --use-checkpoint-opt_param-scheduler, as --lr is."""
    base = dict(lr=3e-3, min_lr=1e-4, train_iters=30, global_batch_size=8, lr_warmup_iters=4)
    saved = LearningRateSchedule.from_config(TrainConfig(**base, decoupled_lr=1e-3))
    new = LearningRateSchedule.from_config(TrainConfig(**base, decoupled_lr=5e-3, decoupled_min_lr=2e-4))
    with pytest.raises(ConfigError) as exc:
        resumed_schedule(new, saved.state(80), False, False)
    assert "--decoupled-lr: 0.001 in the checkpoint, 0.005 now" in str(exc.value)
    assert "--decoupled-min-lr: 0.0001 in the checkpoint, 0.0002 now" in str(exc.value)  # --min-lr's, then
    same = LearningRateSchedule.from_config(TrainConfig(**base, decoupled_lr=1e-3, decoupled_min_lr=1e-4))
    assert resumed_schedule(same, saved.state(80), False, False) == same  # the same final lr, said or not
    loaded = {"max_lr": 1e-3, "min_lr": None, "wd_mult": 1.0}  # a decoupled group as the checkpoint restored it
    for flags, (peak, final) in (((True, False), (5e-3, 2e-4)), ((False, True), (1e-3, 1e-4))):
        schedule, group = resumed_schedule(new, saved.state(80), *flags), dict(loaded)
        assert schedule.group_lr(8 * 4, group) == pytest.approx(peak)  # the warmup's end: the peak
        assert schedule.group_lr(8 * 30, group) == pytest.approx(final)  # past the decay: the final lr
        assert group["max_lr"] == peak
        assert schedule.group_lr(8 * 4, {"wd_mult": 1.0}) == pytest.approx(3e-3)  # the other groups: --lr


def test_resuming_an_import_starts_the_command_lines_schedule():
    """A Hugging Face import is iteration 0 with no schedule and no train section: resuming it without
    --finetune runs the command line's schedule from 0 (it once raised a TypeError computing an old one)."""
    from moezero.training.configs import CheckpointConfig
    from moezero.training.resume import ResumePoint, start_lr_schedule

    t = TrainConfig(lr=3e-3, train_iters=30, global_batch_size=8)
    current = LearningRateSchedule.from_config(t)
    imported = ResumePoint("x", 0, {"model": {}, "hf": {}}, {}, {}, {})
    assert start_lr_schedule(current, imported, CheckpointConfig(), t) == (current, 0)


def test_the_loop_steps_at_megatrons_lr(tmp_path, monkeypatch):
    """The lr each step of the real loop runs at (read from the optimizer as the step starts) is the one
    Megatron's scheduler gives that step: the warmup's init at the first, then one global batch further each."""
    from moezero.recipe import pretraining
    from moezero.training import pretrain
    from tests.integration.pretrain_utils import TINY, configs

    used = []

    def recording(model, opt, *args, **kwargs):
        used.append({group["lr"] for group in opt.param_groups})
        return train_step(model, opt, *args, **kwargs)

    train_step = pretrain.train_step
    monkeypatch.setattr(pretrain, "train_step", recording)
    run = pretraining(
        configs(TINY + ["--train-iters", "6", "--lr-warmup-init", "1e-4", "--data-cache-path", str(tmp_path)])
    )
    run.train()
    run.groups.destroy()
    theirs, optimizer = megatron_scheduler(run.cfg.train)
    expected = []
    for _ in range(6):
        expected.append({optimizer.param_groups[0]["lr"]})
        theirs.step(increment=run.cfg.train.global_batch_size)
    assert used == expected and len(set(map(min, expected))) == 6
