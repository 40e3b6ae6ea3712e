"""--overlap-moe-expert-parallel-comm: micro-batches in pairs, their forwards interleaved phase by phase and their
backward one; the numbers of the micro-batches one after another (float64, 2 ranks, ep 2, ZeRO stages 0-2), with
--delay-wgrad-compute too."""

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.config.options import ConfigError
from moezero.parallel import ParallelGroups
from moezero.torch_internals import in_backward
from moezero.training.configs import validate
from moezero.training.loop import train_step
from moezero.training.run_start import resolve_start
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs

VOCAB, SEQ, MB = 64, 32, 2
EVERY_SCHEDULE = ((0, 4, False), (2, 3, True), (1, 2, False))  # (stage, micro-batches, --delay-wgrad-compute)
# flags, the schedules they run: the shared expert, global aux loss and MTP interleaved; recomputed MoE layers
# run whole (phases.module_steps never sees them) beside interleaved dense ones
CASES = [
    ([], EVERY_SCHEDULE),
    (
        [
            "--moe-shared-expert-intermediate-size",
            "16",
            "--moe-router-load-balancing-type",
            "global_aux_loss",
            "--moe-layer-freq",
            "[0,1,1]",
            "--num-layers",
            "3",
            "--mtp-num-layers",
            "1",
            "--position-embedding-type",
            "rope",
        ],
        EVERY_SCHEDULE,
    ),
    (["--moe-layer-recompute", "--moe-router-load-balancing-type", "global_aux_loss"], ((2, 3, True),)),
]


def _micro_batches(step, count):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 * step + rank)
    batches = []
    for j in range(count):
        first = (step * count + j) * 2 * MB + rank * MB
        batches.append(
            {
                "tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "loss_mask": (torch.rand(MB, SEQ, generator=g) > 0.1).double(),
                "sample_index": torch.arange(first, first + MB),
            }
        )
    return batches


def _train(flags, stage, micro_batches, overlap, steps=2):
    cfg = configs(TINY + flags)
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = GPTModel(
        dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe, seed=3, moe_layer=expert_parallel(groups)
    ).double()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        groups,
        stage=stage,
        bucket_size=300,
        clip_grad=1.0,
        grad_reduce_dtype=torch.float64,
        lr=1e-2,
    )
    history = []
    for step in range(steps):
        m = train_step(model, opt, _micro_batches(step, micro_batches), step, 7, groups.dp, overlap_moe_comm=overlap)
        history.append((m.lm_loss, m.router_losses, m.grad_norm, m.tokens_per_expert))
    with opt.full_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups.destroy()
    return history, params


def _compare_overlap(flags, stage, micro_batches, delay_wgrad=False):
    plain_history, plain = _train(flags, stage, micro_batches, overlap=False)
    history, params = _train(
        flags + (["--delay-wgrad-compute"] if delay_wgrad else []), stage, micro_batches, overlap=True
    )
    for (lm, router, norm, counts), (lm0, router0, norm0, counts0) in zip(history, plain_history):
        assert lm == pytest.approx(lm0, rel=1e-12) and norm == pytest.approx(norm0, rel=1e-12), (lm, lm0, norm, norm0)
        assert router == pytest.approx(router0, rel=1e-12)
        assert torch.equal(counts, counts0)
    for name, p in plain.items():
        torch.testing.assert_close(params[name], p, rtol=1e-11, atol=1e-13, msg=name)


def _all_cases():
    for flags, schedules in CASES:
        for stage, micro_batches, delay_wgrad in schedules:
            _compare_overlap(flags, stage, micro_batches, delay_wgrad)


def test_interleaved_micro_batches_give_the_numbers_of_consecutive_ones():
    run_distributed(_all_cases, 2)


class _InFlight:
    """Counts the token all-to-alls launched and not yet waited for, the most at once in forward and backward
    (whichever transport carries them: comm._launch)."""

    def __init__(self, launch):
        self.now, self.most = 0, {"forward": 0, "backward": 0}
        self.launch = launch

    def __call__(self, *args, **kwargs):
        work = self.launch(*args, **kwargs)
        self.now += 1
        phase = "backward" if in_backward() else "forward"
        self.most[phase] = max(self.most[phase], self.now)
        return _Counted(work, self)


class _Counted:
    def __init__(self, work, counter):
        self.work, self.counter, self.done = work, counter, False

    def wait(self, *args):
        result = self.work.wait(*args)
        if not self.done:
            self.done, self.counter.now = True, self.counter.now - 1
        return result


def _most_in_flight(overlap):
    from moezero.parallel import comm

    counter = _InFlight(comm._launch)
    comm._launch = counter
    try:
        _train([], 2, 2, overlap, steps=1)
    finally:
        comm._launch = counter.launch
    return counter.most


def test_a_pairs_exchanges_travel_while_the_other_micro_batch_computes():
    """The interleaving happens, in forward and (autograd taking the latest-made node first) in backward: one
    micro-batch's token all-to-all is launched before the other's is waited for; one after another, never."""
    for most in run_distributed(_most_in_flight, 2, True):
        assert most == {"forward": 2, "backward": 2}, most
    for most in run_distributed(_most_in_flight, 2, False):
        assert most == {"forward": 1, "backward": 1}, most


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--expert-model-parallel-size", "1"], "needs --expert-model-parallel-size > 1"),
        (
            ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
            "needs --moe-token-dispatcher-type alltoall or flex",
        ),
    ],
)  # Megatron's rules (test_megatron_rules: the others)
def test_the_overlap_refuses_what_it_cannot_overlap(flags, message):
    cfg = configs(TINY + ["--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type", "alltoall"] + flags)
    with pytest.raises(ConfigError, match=re.escape(f"--overlap-moe-expert-parallel-comm: {message}")):
        validate(cfg, world_size=2)


def test_the_log_says_which_layers_run_whole():
    flags = TINY + [
        "--overlap-moe-expert-parallel-comm",
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
    ]
    assert not any("overlap" in line for line in resolve_start(configs(flags)).notices)
    notices = resolve_start(configs(flags + ["--moe-layer-recompute"])).notices
    assert any("the layers --moe-layer-recompute recomputes run whole" in line for line in notices), notices
    notices = resolve_start(
        configs(
            flags + ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
        )
    ).notices
    assert any(
        "--recompute-granularity full (--recompute-method block) recomputes run whole" in line for line in notices
    ), notices


def test_delayed_weight_gradients_need_the_overlap():
    cfg = configs(TINY + ["--expert-model-parallel-size", "2", "--delay-wgrad-compute"])
    with pytest.raises(ConfigError, match="--delay-wgrad-compute: needs --overlap-moe-expert-parallel-comm"):
        validate(cfg, world_size=2)


def _live_tensors_per_step(stage, overlap, steps=8):
    """Python tensors alive after each training step (gc collected), the model's and optimizer's included."""
    import gc

    cfg = configs(TINY)
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = GPTModel(
        dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe, seed=3, moe_layer=expert_parallel(groups)
    ).double()
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, bucket_size=300, lr=1e-2)
    alive = []
    for step in range(steps):
        train_step(model, opt, _micro_batches(step, 2), step, 7, groups.dp, overlap_moe_comm=overlap)
        gc.collect()
        pooled = _pooled_storages(opt)
        alive.append(sum(1 for o in gc.get_objects() if torch.is_tensor(o) and _storage(o) not in pooled))
    groups.destroy()
    return alive


def _storage(tensor):
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a wrapper subclass): counted
        return None


def _pooled_storages(opt):
    """The gradient staging buffers stages 2 and 3 keep for reuse (at most two buckets' worth: bounded, tested in
    test_zero_behaviour). Not counted: how many a step leaves pooled, and the params' views each builds for the
    buckets it served, depend on when the ranks' reductions completed against when they were polled."""
    return {
        staging.tensor.untyped_storage().data_ptr()
        for part in opt.engine.parts
        for buffers in getattr(part.strategy, "_pool", {}).values()
        for staging in buffers
    }


def _live_tensors_by_run():
    return {
        (stage, overlap): _live_tensors_per_step(stage, overlap)
        for stage, overlap in ((2, False), (2, True), (3, False))
    }


def test_training_steps_leave_no_tensors_behind():
    """A long run's memory stays flat: after the first steps, every step frees all it made (a launched
    all-to-all once kept its rows alive through its work, ~8 MB a step on the benchmarks' GPT-MoE). A leak
    raises the count at every later step, so the last steps' least stays above the earlier steps' most; a gloo
    worker thread still releasing a work that completed (its tensors, for a moment) raises one step's count."""
    for by_run in run_distributed(_live_tensors_by_run, 2):
        for run, alive in by_run.items():
            assert min(alive[5:]) <= max(alive[2:5]), (run, alive)
