"""The Megatron flags of the training script in one process: parsing, one-line errors, the sample-based
schedule, stop conditions and the interrupt message."""

import os
import re
import signal
import time

import pytest
import torch.distributed as dist

from moezero.config import ConfigError, ParallelConfig, ZeroConfig
from moezero.recipe import CONFIG_CLASSES
from moezero.training.args import build_parser, parse_configs
from moezero.training.configs import DESCRIPTION, TrainConfig
from moezero.training.job import interrupt_message
from moezero.training.lr_schedule import LearningRateSchedule
from moezero.training import stopping
from moezero.training.stopping import StopConditions
from tests.dist_utils import run_distributed


def _error_of(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_configs(argv, CONFIG_CLASSES, DESCRIPTION)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_a_typo_is_one_line_with_a_did_you_mean(capsys):
    lines = _error_of(["--hiden-size", "64", "--num-layers", "2"], capsys)
    assert len(lines) == 1 and "did you mean --hidden-size?" in lines[0] and "see --help" in lines[0], lines
    lines = _error_of(["--expert-tensor-parallel-size", "0"], capsys)
    assert len(lines) == 1 and "--expert-tensor-parallel-size=0: must be >= 1" in lines[0]
    lines = _error_of(["--fp8-format", "hybrid", "--fp8-margin", "0", "--hiden-size", "64"], capsys)
    assert [line.split("error: ", 1)[1] for line in lines] == [
        "3 problems with this launch line:",
        "--fp8-format: not supported by moezero (a Megatron-LM flag; see docs/megatron.md, 'Coming from Megatron-LM')",
        "--fp8-margin: not supported by moezero (a Megatron-LM flag; see docs/megatron.md, 'Coming from Megatron-LM')",
        "unrecognized arguments: --hiden-size 64; did you mean --hidden-size? (see --help)",
    ], lines
    lines = _error_of(["--mtp-standalone"], capsys)  # never a did-you-mean to another flag (--mtp-num-layers)
    assert len(lines) == 1 and "--mtp-standalone: not supported by moezero" in lines[0] and "mean" not in lines[0]
    lines = _error_of(["--ckpt-format", "torch"], capsys)
    assert lines[0].endswith(
        "--ckpt-format torch: not supported by moezero (choose from 'torch_dist', 'fsdp_dtensor') (see --help)"
    ), lines
    # Megatron's store_false switches have only their --no- form: never a did-you-mean of the opposite meaning
    lines = _error_of(["--bias-gelu-fusion"], capsys)
    assert len(lines) == 1 and lines[0].endswith(
        "unrecognized arguments: --bias-gelu-fusion; that is on by default "
        "(--no-bias-gelu-fusion turns it off) (see --help)"
    ), lines
    lines = _error_of(["--bias-gelu-fusio"], capsys)
    assert (
        "did you mean" not in lines[0] and "the nearest flag, --no-bias-gelu-fusion, turns an option off" in lines[0]
    ), lines


def test_one_launch_lists_every_problem_one_line_each(capsys):
    """The DeepSeek-V3 line took four launches to list what moezero refuses: flags, choices, values of the wrong
    type and values the configs refuse now come together."""
    lines = _error_of(
        [
            "--expert-tensor-parallel-size",
            "0",
            "--ckpt-format",
            "torch",
            "--mtp-standalone",
            "--num-layers",
            "two",
            "--lr",
            "-1",
            "--num-experts",
            "0",
            "--fp8-format",
            "hybrid",
            "--hiden-size",
            "64",
        ],
        capsys,
    )
    expected = [
        "8 problems with this launch line:",
        "--ckpt-format torch: not supported by moezero",
        "--num-layers: invalid int value: 'two'",
        "--mtp-standalone: not supported by moezero",
        "--fp8-format: not supported by moezero",
        "unrecognized arguments: --hiden-size 64; did you mean --hidden-size?",
        "--expert-tensor-parallel-size=0: must be >= 1",
        "--num-experts=0: must be >= 1",
        "--lr=-1.0: must be > 0",
    ]  # the model's section holds the unreadable --num-layers: not built
    assert len(lines) == len(expected) and all(e in line for e, line in zip(expected, lines)), lines
    assert lines[-1].endswith("(see --help)") and all("error: " in line for line in lines)


def _launch_error_of(argv, capsys):
    """The error lines of the script's entry point (its parse: before any process group or model)."""
    from moezero.recipe import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return [line.split("error: ", 1)[1] for line in capsys.readouterr().err.strip().splitlines()]


def test_one_launch_names_every_refused_value(capsys):
    """Issue 77: refused values took several launches to list; now one error, headed by how many. Its line (tp, cp,
    pp and etp 2 together) runs: only the values refused elsewhere are named."""
    argv = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    argv += ["--expert-tensor-parallel-size", "2", "--sequence-parallel", "--cp-comm-type", "a2a+p2p"]
    lines = _launch_error_of(argv + ["--hierarchical-context-parallel-sizes", "2", "1"], capsys)
    assert lines[0] == "2 flags of this launch line are not supported:" and len(lines) == 3, lines
    assert lines[1].startswith("--hierarchical-context-parallel-sizes: not supported by moezero"), lines
    assert lines[2].startswith("--cp-comm-type=['a2a+p2p']: not supported by moezero: a2a+p2p"), lines
    assert lines[-1].endswith("(see --help)")
    # one alone: the one line it always was
    lines = _launch_error_of(argv, capsys)
    assert len(lines) == 1 and lines[0].startswith("--cp-comm-type=['a2a+p2p']: not supported by moezero"), lines


def test_one_launch_names_what_context_parallelism_does_not_run(capsys):
    """What cp x pp still refuses (the pipeline's line; multi-latent attention runs there); then what cp > 1
    refuses: a2a+p2p and its hierarchical sizes, listed with the values."""
    argv = ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"]
    lines = _launch_error_of(argv + ["--zero-stage", "3", "--multi-latent-attention"], capsys)
    assert len(lines) == 1 and lines[0].startswith("--zero-stage=3: not supported with pipeline stages yet"), lines
    argv = ["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes"]
    lines = _launch_error_of(argv + ["2", "1", "--multi-latent-attention"], capsys)
    assert lines[0] == "2 flags of this launch line are not supported:" and len(lines) == 3, lines
    assert lines[1].startswith("--hierarchical-context-parallel-sizes: not supported by moezero"), lines
    assert lines[2].startswith("--cp-comm-type=['a2a+p2p']: not supported by moezero: a2a+p2p"), lines


CP_RULES = [
    (["--context-parallel-size", "4"], 2, "--context-parallel-size=4: must divide the number of processes (2)"),
    (["--seq-length", "30"], 2, "--seq-length=30: must be divisible by 2 x --context-parallel-size = 4"),
    (["--cp-comm-type", "p2p", "a2a", "p2p"], 2, "--cp-comm-type=p2p a2a p2p: one type for every layer or one per"),
    (["--cp-comm-type", "a2a", "--num-attention-heads", "1", "--kv-channels", "32"], 2, "--cp-comm-type a2a: needs"),
]


@pytest.mark.parametrize("argv,world,needle", CP_RULES, ids=[needle.split(":")[0] for _, _, needle in CP_RULES])
def test_context_parallel_rules_are_megatrons_one_line_each(argv, world, needle):
    """Megatron's validate_args: world % cp, seq_length % (2 cp), --cp-comm-type one or one per layer (2 layers
    here), a2a's heads % cp; each one line at start (validate)."""
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY, configs

    cp = [] if "--context-parallel-size" in argv else ["--context-parallel-size", "2"]
    with pytest.raises(ConfigError) as info:
        validate(configs(TINY + cp + argv), world_size=world)
    message = str(info.value)
    assert message.startswith(needle) and len(message.splitlines()) == 1, message


def test_tensor_x_context_parallel_rules_one_line_each():
    """tp 2 x cp 2 runs, with the experts' default tensor parallelism (etp = tp) too; a2a splits each tp rank's heads
    over cp (Megatron's heads / tp % cp)."""
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY, configs

    capacity = TINY.index("--moe-expert-capacity-factor")
    tpcp = (
        TINY[:capacity] + TINY[capacity + 2 :] + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
    )
    tpcp += ["--sequence-parallel"]
    assert validate(configs(tpcp + ["--expert-tensor-parallel-size", "1"]), world_size=4) == 4  # dp 1: 8 / 2
    assert validate(configs(tpcp), world_size=4) == 4
    for argv, needle in (
        (["--cp-comm-type", "a2a"], "--cp-comm-type a2a: needs the attention heads (1) and query groups (1) of a rank"),
    ):
        with pytest.raises(ConfigError) as info:
            validate(configs(tpcp + argv), world_size=4)
        message = str(info.value)
        assert message.startswith(needle) and len(message.splitlines()) == 1, message


def test_context_parallel_deals_micro_batches_over_data_parallel_ranks():
    """cp 2 on 4 processes: 2 data-parallel ranks deal the batch (8 = 2 per micro-batch x 2 ranks x 2 steps)."""
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY, configs

    assert validate(configs(TINY + ["--context-parallel-size", "2"]), world_size=4) == 2
    assert validate(configs(TINY), world_size=4) == 1


def test_one_launch_names_refused_values_with_what_pipeline_stages_refuse(capsys):
    """A refused value (cp's a2a+p2p) does not hide what pp > 1 refuses of the same line, each listed once; the
    combination rules that need a valid line still wait for it (no noise lines)."""
    pp_size = "(--pipeline-model-parallel-size=2)"
    overlap = "--overlap-moe-expert-parallel-comm: not supported with pipeline stages yet"
    argv = ["--pipeline-model-parallel-size", "2", "--zero-stage", "3", "--overlap-moe-expert-parallel-comm"]
    lines = _launch_error_of(argv + ["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], capsys)
    assert lines[0] == "3 flags of this launch line are not supported:", lines
    assert lines[1].startswith("--cp-comm-type=['a2a+p2p']: not supported by moezero"), lines
    assert lines[2].startswith("--zero-stage=3: not supported with pipeline stages yet") and pp_size in lines[2]
    assert lines[3].startswith(overlap) and lines[3].endswith(f"{pp_size} (see --help)"), lines
    assert len(lines) == 4, lines
    # pp > 1's refusals together without a refused value too
    lines = _launch_error_of(argv, capsys)
    assert lines[0] == "2 flags of this launch line are not supported:" and len(lines) == 3, lines
    assert lines[1].startswith("--zero-stage=3") and lines[2].startswith(overlap), lines
    # stage 3 only where typed (pp's default is stage 0)
    lines = _launch_error_of(["--pipeline-model-parallel-size", "2", "--overlap-moe-expert-parallel-comm"], capsys)
    assert len(lines) == 1 and lines[0].startswith(overlap), lines


def test_help_has_no_placeholders_and_each_default_once():
    text = build_parser(CONFIG_CLASSES, DESCRIPTION).format_help()
    assert "MODEL." not in text and "TRAIN." not in text and "--num-layers NUM_LAYERS" in text
    assert "(default: None)" not in text
    entries = re.split(r"\n  (?=--)", text)  # one entry per flag: its name line(s) and help
    for flag in ("--moe-grouped-gemm", "--seq-length", "--lr-warmup-iters", "--num-experts"):
        entry = next(e for e in entries if e.startswith(flag + " ") or e.startswith(flag + ","))
        assert entry.count("default") == 1, entry


def test_every_boolean_flag_sets_its_field():
    """Each bool flag, given alone, turns its field on (and off where it defaults on), whatever its name:
    --no-load-optim and --no-load-rng once parsed as their own negation and silently did nothing."""
    from moezero.training.args import flag_fields

    parser = build_parser(CONFIG_CLASSES, DESCRIPTION)
    checked = 0
    for cls in CONFIG_CLASSES:
        for f, flag in flag_fields(cls):
            if f.type not in (bool, "bool"):
                continue
            namespace = parser.parse_args([flag])
            assert getattr(namespace, f"{cls.section}.{f.name}") is True, flag
            checked += 1
    assert checked > 10


def test_args_file_reads_megatron_style_lines(tmp_path):
    args = tmp_path / "flags.txt"
    args.write_text("# a launch script's flags\n--num-layers 3 --hidden-size 48\n--use-distributed-optimizer\n")
    cfg = parse_configs([f"@{args}", "--num-attention-heads", "3"], CONFIG_CLASSES, DESCRIPTION)
    assert (cfg["model"].num_layers, cfg["model"].hidden_size, cfg["zero"].stage) == (3, 48, 1)


def test_megatron_parallel_and_optimizer_flags():
    assert ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=2, context_parallel_size=1)
    assert ParallelConfig(context_parallel_size=2, cp_comm_type=["a2a"]).context_parallel_size == 2
    assert ParallelConfig(tensor_parallel_size=2).tensor_parallel_size == 2
    assert ParallelConfig(expert_tensor_parallel_size=2).expert_tensor_parallel == 2
    assert ParallelConfig(tensor_parallel_size=2).expert_tensor_parallel == 2  # Megatron's default: tp
    assert ParallelConfig(expert_tensor_parallel_size=2, context_parallel_size=2, pipeline_parallel_size=2)
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2).pipeline_parallel_size == 2
    assert ParallelConfig(tensor_parallel_size=2, context_parallel_size=2).context_parallel_size == 2
    assert ParallelConfig(tensor_parallel_size=2, context_parallel_size=2, pipeline_parallel_size=2)
    assert ZeroConfig().stage == 2 and ZeroConfig(use_distributed_optimizer=True).stage == 1
    assert ZeroConfig(use_distributed_optimizer=True, stage=3).stage == 3


def test_sample_based_schedule_is_megatrons():
    t = TrainConfig(
        global_batch_size=8, train_samples=800, lr=1.0, min_lr=0.0, lr_warmup_fraction=0.1, lr_decay_style="linear"
    )
    assert t.train_iters == 100
    # warmup 80 samples = 10 iterations, then linear decay over the remaining 720 samples
    lr = LearningRateSchedule.from_config(t).lr
    assert lr(0) == 0.0 and lr(8) == pytest.approx(0.1) and lr(80) == pytest.approx(1.0)
    assert lr(440) == pytest.approx(1 - (55 * 8 - 80) / 720)
    iters = TrainConfig(
        train_iters=100, global_batch_size=8, lr=1.0, min_lr=0.0, lr_warmup_fraction=0.1, lr_decay_style="linear"
    )
    assert [LearningRateSchedule.from_config(iters).lr(i * 8) for i in (0, 9, 55)] == pytest.approx(
        [lr(i * 8) for i in (0, 9, 55)]
    )
    assert TrainConfig().lr_warmup_iters == 0 and TrainConfig().train_iters == 200  # Megatron: no warmup


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (
            dict(train_samples=64, train_iters=3, global_batch_size=16),
            "--train-iters=3: give --train-iters or --train-samples",
        ),
        (dict(train_samples=64, lr_warmup_iters=5), "--lr-warmup-iters=5: counts iterations"),
        (dict(lr_warmup_samples=8), "--lr-warmup-samples=8: needs --train-samples"),
        (dict(lr_warmup_iters=5, lr_warmup_fraction=0.1), "give one of --lr-warmup-iters"),
        (dict(lr_warmup_fraction=1.5), "--lr-warmup-fraction=1.5: must be in [0, 1]"),
    ],
)
def test_schedule_flags_conflicts_name_the_flag(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**kwargs)
    assert needle in str(info.value)


def test_stop_conditions_record_a_signal_and_the_duration():
    stop = StopConditions(TrainConfig(exit_signal_handler=True), None)
    try:
        assert stop.reason(1) is None
        signal.raise_signal(signal.SIGTERM)  # recorded, not fatal: the iteration in flight finishes
        signal.raise_signal(signal.SIGTERM)  # Slurm's and torchrun's forwarded one: still only recorded
        assert stop.reason(2) == "received SIGTERM"
    finally:
        stop.close()
    stop = StopConditions(TrainConfig(exit_signal_handler=True, exit_signal="SIGUSR1"), None)  # Slurm's USR1@
    try:
        signal.raise_signal(signal.SIGUSR1)
        assert stop.reason(2) == "received SIGUSR1" and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        stop.close()
    stop = StopConditions(TrainConfig(exit_signal_handler=True), None)
    try:
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice interrupts at once
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    stop = StopConditions(TrainConfig(exit_duration_in_mins=1e-9), None)
    assert "--exit-duration-in-mins" in stop.reason(1)
    assert StopConditions(TrainConfig(exit_interval=5, train_iters=20), None).reason(5) == "--exit-interval=5"


def test_a_signal_in_the_last_iteration_lets_the_run_finish():
    """The run is done then: it saves (first), evaluates the test split and exports as any finished run; a stop
    would skip those, and the relaunch would find nothing to train."""
    stop = StopConditions(TrainConfig(exit_signal_handler=True, train_iters=4), None)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert stop.reason(4) is None
        assert stop.reason(3) == "received SIGTERM"
    finally:
        stop.close()


def test_the_duration_counts_from_the_scripts_start(monkeypatch):
    """As Megatron's: the data build and the checkpoint load count (here two minutes of them)."""
    monkeypatch.setattr(stopping, "PROCESS_START", time.monotonic() - 120)
    assert "--exit-duration-in-mins=1 reached" in StopConditions(TrainConfig(exit_duration_in_mins=1), None).reason(1)


def _signal_on_rank_0_only():
    from moezero.parallel import ParallelGroups

    groups = ParallelGroups.build()
    stop = StopConditions(TrainConfig(exit_signal_handler=True), groups.control)
    try:
        first = stop.reason(1)
        if dist.get_rank() == 0:  # a scheduler's SIGTERM that reached one rank
            signal.raise_signal(signal.SIGTERM)
        return first, stop.reason(2)
    finally:
        stop.close()
        groups.destroy()


def test_a_signal_reaching_some_ranks_stops_every_rank_after_the_same_iteration():
    assert run_distributed(_signal_on_rank_0_only, 2) == [(None, "received SIGTERM")] * 2


def test_the_interrupt_message_says_what_is_on_disk(tmp_path):
    assert "nothing was saved (no --save)" in interrupt_message(None)
    assert f"no complete checkpoint in {tmp_path}" in interrupt_message(str(tmp_path))
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    (tmp_path / "iter_0000004.tmp").mkdir()
    message = interrupt_message(str(tmp_path))
    assert f"the last complete checkpoint is {os.path.join(tmp_path, 'iter_0000002')}" in message
    assert "the unfinished save iter_0000004.tmp is ignored by --load" in message


def test_an_error_raised_inside_a_data_worker_keeps_its_traceback():
    """torch re-raises a reader's own error as 'Caught RuntimeError in DataLoader worker process 0': a bug to
    see, not a worker the OOM killer took."""
    from moezero.training.job import _a_data_worker_died

    assert not _a_data_worker_died(RuntimeError("Caught RuntimeError in DataLoader worker process 0.\nTraceback"))
    assert _a_data_worker_died(RuntimeError("DataLoader worker (pid 12) is killed by signal: Killed. "))


@pytest.mark.parametrize("failure", ["channel", "disagree", "data worker"])
def test_a_peer_that_died_or_went_elsewhere_is_one_line(failure, monkeypatch, capsys):
    """Where ranks share a host their messages go through pipes: a dead peer is a ChannelError, a peer that went
    elsewhere a RanksDisagree; a data-loading worker killed (the out-of-memory killer) torch's RuntimeError; each
    ends the run with one line and exit code 1 (they were tracebacks)."""
    from moezero.parallel.agreement import RanksDisagree
    from moezero.parallel import ChannelError
    from moezero.training import job

    error = {
        "channel": ChannelError(
            "rank 1 of the control group exited or stopped reading (its end of the pipe is closed)"
        ),
        "disagree": RanksDisagree("rank 0 was saving a checkpoint; rank 1 was in a forward"),
        "data worker": RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly"),
    }[failure]

    class Failing:
        def __init__(self, cfg, plugins):
            pass

        def train(self):
            raise error

    monkeypatch.setattr(job, "init_distributed", lambda backend, minutes: None)
    monkeypatch.setattr(job, "Pretraining", Failing)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    from tests.integration.pretrain_utils import configs

    assert job.run(configs([])) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(error).split(";")[0] in lines[0], lines


# ---- pipeline stages: what runs, what is refused at start ---------------------------------------------
PP2 = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights", "--zero-stage", "1"]


def _pipeline_configs(extra):
    from tests.integration.pretrain_utils import TINY, configs

    return configs(TINY + PP2 + extra)


def test_a_pipeline_run_deals_the_batch_over_its_data_parallel_ranks():
    """--global-batch-size 8 of micro-batches of 2: 4 micro-steps on 2 ranks at pp 2 (one pipeline), 2 on 4 ranks
    (two pipelines); without --global-batch-size Megatron's default is --micro-batch-size x the dp size."""
    from moezero.training.configs import validate

    assert validate(_pipeline_configs([]), world_size=2) == 4
    assert validate(_pipeline_configs([]), world_size=4) == 2
    cfg = _pipeline_configs([])
    cfg.train.global_batch_size = None
    validate(cfg, world_size=4)
    assert cfg.train.global_batch_size == 2 * 2


@pytest.mark.parametrize(
    "extra,stage,notice",
    [
        ([], 0, "--pipeline-model-parallel-size=2 without --zero-stage: ZeRO stage 0 (Megatron's data parallel;"),
        (["--use-distributed-optimizer"], 1, None),  # Megatron's distributed optimizer: stage 1 already
        (["--zero-stage", "1"], 1, None),
        (["--zero-stage", "2"], 2, None),  # typed: kept
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim"], 1, None),
    ],
)
def test_without_zero_stage_a_pipeline_run_takes_megatrons_stage(extra, stage, notice):
    """Megatron runs a pp > 1 line without --use-distributed-optimizer with its DDP (ZeRO stage 0's numbers), so
    moezero's default stage 2 gives way to 0 there (1 with --use-distributed-optimizer), said in one line; a typed
    --zero-stage stands. At pp 1 the default stays 2."""
    from moezero.training.configs import validate
    from moezero.training.pipeline_checks import resolve_pipeline_zero_stage
    from tests.integration.pretrain_utils import TINY, configs

    cfg = configs(TINY + ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"] + extra)
    got = resolve_pipeline_zero_stage(cfg)
    assert cfg.zero.stage == stage and (got is None if notice is None else got.startswith(notice)), got
    assert got is None or len(got.splitlines()) == 1
    assert resolve_pipeline_zero_stage(cfg) is None  # resolved once: the script's later checks see the same stage
    if stage in (0, 1):
        assert validate(cfg, world_size=2) == 4
    single = configs(TINY)
    assert resolve_pipeline_zero_stage(single) is None and single.zero.stage == 2


@pytest.mark.parametrize(
    "extra,world,needle",
    [
        (
            ["--decoder-first-pipeline-num-layers", "3"],
            2,
            "--decoder-first-pipeline-num-layers=3: more than --num-layers=2",
        ),
        (["--num-layers", "3"], 2, "--num-layers=3: must be divisible by --pipeline-model-parallel-size=2"),
        (["--pipeline-model-parallel-layout", "Et|tt|L"], 2, "--pipeline-model-parallel-layout='Et|tt|L'"),
        ([], 3, "--pipeline-model-parallel-size=2: must divide the world size (3)"),
        (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size=2, --pipeline-model-parallel-size=2"),
    ],
)
def test_a_bad_pipeline_layout_is_one_line_at_start(extra, world, needle):
    from moezero.training.configs import validate

    with pytest.raises(ConfigError) as info:
        validate(_pipeline_configs(extra), world_size=world)
    assert needle in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)


PIPELINE_REFUSALS = [
    (PP2 + ["--zero-stage", "3"], "--zero-stage=3: not supported with pipeline stages yet"),
    (PP2 + ["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm: not supported with pipeline"),
]


@pytest.mark.parametrize(
    "argv,needle", PIPELINE_REFUSALS, ids=[needle.split(":")[0] for _, needle in PIPELINE_REFUSALS]
)
def test_what_pipeline_stages_do_not_run_yet_is_one_line_at_start(argv, needle):
    """Each refused at start (validate, which the script runs before building anything) in one line naming the flag
    and the pipeline size."""
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY, configs

    with pytest.raises(ConfigError) as info:
        validate(configs(TINY + argv), world_size=2)
    message = str(info.value)
    assert needle in message and "--pipeline-model-parallel-size" in message and len(message.splitlines()) == 1, message


def test_what_pipeline_stages_do_not_run_yet_is_listed_whole_at_start():
    """validate (also the check of a run built in-process) lists every refusal of pp > 1, not the first."""
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY, configs

    argv = PP2 + ["--zero-stage", "3", "--overlap-moe-expert-parallel-comm"]
    with pytest.raises(ConfigError) as info:
        validate(configs(TINY + argv), world_size=2)
    lines = str(info.value).splitlines()
    needles = [needle for _, needle in PIPELINE_REFUSALS]
    assert len(lines) == 2 and all(n in line for n, line in zip(needles, lines)), lines
