"""What a torch user does with an optimizer keeps torch's meaning under ZeroOptimizer.

Each test writes the loop a PyTorch user would write, runs it on N gloo ranks, and compares it
with single-process torch on the same global batch (float64: ~1e-10; the mixed-dtype model has
fp32 params: float tolerance).
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moezero.parallel import ParallelGroups
from moezero.zero import DynamicLossScaler, GradientIsSharded, ShardedGradient, ZeroOptimizer
from tests.dist_utils import assert_replicas_equal, run_distributed
from tests.zero_model import ZeroTestModel, micro_batch
from tests.zero_reference import (
    OPTIMIZERS,
    ZERO_STAGES,
    assert_params_match,
    assert_passes,
    local_reference_slice,
    rank_micro_batches,
    reference_run,
    train_step,
)

TOL = 1e-10
STEPS = 4


def _zero(model, groups, stage, optimizer="adamw", **extra):
    cls, kwargs = OPTIMIZERS[optimizer]
    options = dict(stage=stage, bucket_size=150, grad_reduce_dtype=torch.float64)
    options.update(extra)
    return ZeroOptimizer(model, cls, groups, **options, **kwargs)


def _compare(model, opt, expected, groups, tol=TOL):
    with opt.full_parameters():
        assert_params_match(model, expected, rtol=tol, atol=tol * 1e-3)
        assert_replicas_equal(model, groups)


# ---- stage 0 accumulation without no_sync, fp32: local gradients summed, reduced once -------------------
def _stage0_accumulation_fp32(ep):
    groups = ParallelGroups.build(expert_parallel_size=ep)
    model = ZeroTestModel(groups)
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=0, lr=0.01, bucket_size=64)
    reference = reference_run(
        "adamw",
        dist.get_world_size(),
        2,
        5,
        dtype=torch.float32,
        make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    )
    worst = 0.0
    for step in range(5):
        train_step(model, opt, step, 2, use_no_sync=False)
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        want = local_reference_slice(name, p, reference[-1]["params"][name])
        worst = max(worst, (p.detach() - want).abs().max().item())
    groups.destroy()
    return worst


@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 2)])
def test_stage0_accumulation_without_no_sync_matches_torch_fp32(world, ep):
    # the report: 6.8e-3 / 3.2e-2 / 3.5e-2; stages 1/2 ~1e-6 (fp32 summation order, 5 AdamW steps)
    assert max(run_distributed(_stage0_accumulation_fp32, world, ep)) < 2e-5


# ---- two param dtypes on one dp group, a branch used by one rank --------------------------------
def _mixed_dtypes():
    world = dist.get_world_size()
    reference = reference_run("sgd", world, 2, 3, model_kwargs=dict(mixed_dtypes=True))
    for ep, stage, overlap, bucket_size in [
        (1, 0, True, 16),
        (2, 1, True, 16),
        (2, 2, True, 16),
        (1, 2, False, 150),
        (2, 0, False, 10**9),
    ]:
        groups = ParallelGroups.build(expert_parallel_size=ep)
        model = ZeroTestModel(groups, mixed_dtypes=True).double()
        assert model.fp32_branch.weight.dtype == torch.float32
        opt = _zero(model, groups, stage, "sgd", overlap_comm=overlap, bucket_size=bucket_size)
        for step in range(3):
            train_step(model, opt, step, 2, use_no_sync=stage == 1)
            opt.step()
            opt.zero_grad()
        _compare(model, opt, reference[-1]["params"], groups, tol=1e-5)
        groups.destroy()
    return True


def test_two_param_dtypes_and_a_one_rank_branch_do_not_hang():
    assert all(run_distributed(_mixed_dtypes, 2, timeout=300))
    assert all(run_distributed(_mixed_dtypes, 4, timeout=300))


# ---- model.zero_grad() clears, on every stage ---------------------------------------------------
def _model_zero_grad(stage, set_to_none):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, stage)
    reference = reference_run("adamw", world, 2, STEPS)
    for step in range(STEPS):
        train_step(model, opt, step, 2, use_no_sync=False)
        opt.step()
        if set_to_none == "p.grad = None":
            for p in model.parameters():
                p.grad = None
        else:
            model.zero_grad(set_to_none=set_to_none)  # the torch habit, instead of opt.zero_grad()
    _compare(model, opt, reference[-1]["params"], groups)
    groups.destroy()
    return True


@pytest.mark.parametrize("set_to_none", [True, False, "p.grad = None"])
@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_model_zero_grad_clears_on_every_stage(set_to_none, stage):
    assert_passes(_model_zero_grad, stage, set_to_none)


def _clear_between_micro_batches(stage):
    """Under no_sync, stage 0/1 gradients are local (DDP's meaning): clearing them drops micro-batch 0."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, stage)
    ref_model = ZeroTestModel(ParallelGroups.single()).double()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **OPTIMIZERS["adamw"][1])
    for step in range(3):
        batches = list(rank_micro_batches(step, 2))
        with opt.no_sync():
            model(*batches[0][:2], step, batches[0][2]).backward()
        model.zero_grad()
        model(*batches[1][:2], step, batches[1][2]).backward()
        opt.step()
        opt.zero_grad()
        for r in range(world):  # torch: only each rank's second micro-batch counts
            tokens, targets = micro_batch(step, world + r)
            (ref_model(tokens, targets, step, r == 0) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _compare(model, opt, {n: p.detach() for n, p in ref_model.named_parameters()}, groups)
    groups.destroy()
    return rank


def test_clearing_local_gradients_between_micro_batches():
    for stage in (0, 1):
        run_distributed(_clear_between_micro_batches, 2, stage)


def _clear_after_a_synced_micro_batch(stage):
    """At stages 1-3 a synced backward reduces into this rank's shard at once: clearing p.grad before the next
    micro-batch of the step (model.zero_grad()) keeps it, so both micro-batches count, as in torch."""
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, stage)
    reference = reference_run("adamw", world, 2, STEPS)
    for step in range(STEPS):
        for tokens, targets, branch in rank_micro_batches(step, 2):
            (model(tokens, targets, step, branch) / 2).backward()
            model.zero_grad()
        opt.step()
        opt.zero_grad()
    _compare(model, opt, reference[-1]["params"], groups)
    groups.destroy()
    return True


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_what_stages_1_to_3_reduced_stays_when_the_user_clears_between_micro_batches(stage):
    assert_passes(_clear_after_a_synced_micro_batch, stage)


def test_bf16_params_reduced_in_fp32_show_no_grad():
    """The fp32 gradient has no bf16 tensor to show, at stage 0 too (whose fp32 params show DDP's)."""
    for dtype, shown in ((torch.bfloat16, False), (torch.float32, True)):
        model = ZeroTestModel(ParallelGroups.single()).to(dtype)
        opt = ZeroOptimizer(model, torch.optim.AdamW, stage=0, lr=1e-3)
        model(*micro_batch(0, 0), 0).backward()
        assert all(isinstance(p.grad, ShardedGradient) != shown for p in model.parameters() if p.requires_grad), dtype
        opt.step()


# ---- param_groups are the user's groups; torch lr schedulers take the optimizer -----------------
def _user_groups(model):
    tiny = [model.norm.bias]
    rest = [p for p in model.parameters() if p.requires_grad and p is not model.norm.bias]
    return [{"params": rest}, {"params": tiny, "lr": 0.01, "weight_decay": 0.0}]


SCHEDULERS = {
    "manual": None,
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.9**s, lambda s: 1.0 + s]),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.001),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=STEPS + 1),
}


def _manual_lr(step, opt):
    if step == 2:
        opt.param_groups[1]["lr"] = 0.2  # per group index, as torch users do


def _param_groups_and_schedulers(stage, name):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = ZeroOptimizer(
        model,
        cls,
        groups,
        stage=stage,
        bucket_size=16,
        grad_reduce_dtype=torch.float64,
        param_groups=_user_groups(model),
        **kwargs,
    )
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["params"] == [model.norm.bias]
    make = SCHEDULERS[name]
    scheduler = make(opt) if make else None
    ref_scheduler = []

    def make_ref(m):
        ref_opt = cls(_user_groups(m), **kwargs)
        if make:
            ref_scheduler.append(make(ref_opt))
        return ref_opt

    def each_step(step, m, ref_opt):
        if not make:
            _manual_lr(step, ref_opt)
        elif step > 0:
            ref_scheduler[0].step()  # as the loop below does after each optimizer step

    reference = reference_run("adamw", world, 1, STEPS, make_opt=make_ref, each_step=each_step)
    lrs = []
    for step in range(STEPS):
        if scheduler is None:
            _manual_lr(step, opt)
        train_step(model, opt, step, 1, use_no_sync=False)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    _compare(model, opt, reference[-1]["params"], groups)
    if ref_scheduler:
        ref_scheduler[0].step()  # the loop above stepped its scheduler after the last step too
        assert lrs[-1] == [g["lr"] for g in ref_scheduler[0].optimizer.param_groups]
    groups.destroy()
    return lrs


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_param_groups_are_the_users_and_lr_schedulers_work(name):
    for stage in ZERO_STAGES[1:]:  # on 4 ranks with 16-element buckets some ranks own no piece of group 1
        lrs = run_distributed(_param_groups_and_schedulers, 4, stage, name)
        assert all(r == lrs[0] for r in lrs)


# ---- state_dict -> load_state_dict on the same layout, every stage -------------------------------
def _state_round_trip(stage):
    groups = ParallelGroups.build(expert_parallel_size=2)

    def build():
        model = ZeroTestModel(groups).double()
        return model, _zero(model, groups, stage)

    model, opt = build()
    for step in range(2):
        train_step(model, opt, step, 2, False)
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    for step in range(2, 4):
        train_step(model, opt, step, 2, False)
        opt.step()
        opt.zero_grad()
    with opt.full_parameters():
        straight = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, opt = build()
    opt.load_state_dict(saved)
    for step in range(2, 4):
        train_step(model, opt, step, 2, False)
        opt.step()
        opt.zero_grad()
    with opt.full_parameters():
        assert all(torch.equal(straight[n], p) for n, p in model.named_parameters()), "resume must be bit-exact"
    groups.destroy()
    return True


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_state_dict_round_trip_on_the_same_layout(stage):
    assert_passes(_state_round_trip, stage)


# ---- a second ZeroOptimizer for the same model just works ----------------------------------------
def _rebuild(first_stage, second_stage):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    cls, kwargs = OPTIMIZERS["sgd"]
    opt = _zero(model, groups, first_stage, "sgd")

    def each_step(step, m, ref_opt):
        if step == 2:  # torch: a fresh optimizer (fresh momentum) from step 2 on
            ref_opt.__init__([p for p in m.parameters() if p.requires_grad], **kwargs)

    reference = reference_run("sgd", world, 2, STEPS, each_step=each_step)
    for step in range(STEPS):
        if step == 2:
            opt = _zero(model, groups, second_stage, "sgd")
        train_step(model, opt, step, 2, False)
        opt.step()
        opt.zero_grad()
    _compare(model, opt, reference[-1]["params"], groups)
    groups.destroy()
    return True


def test_building_a_new_optimizer_for_the_model_just_works():
    for first, second in [(2, 2), (0, 1), (1, 0), (3, 2), (2, 3)]:
        if {first, second} <= set(ZERO_STAGES):
            assert all(run_distributed(_rebuild, 2, first, second))


# ---- a backward that raises, caught by the loop -----------------------------------------------
class _Boom(RuntimeError):
    pass


def _raising_backward(stage, clear_name):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, stage, bucket_size=16)
    armed = []

    def boom(grad):
        if armed:
            armed.clear()
            raise _Boom("a hook failed half-way through backward")

    def arm_on_output(module, inputs, out):
        if out[0].requires_grad:
            out[0].register_hook(boom)

    model.moe1.register_forward_hook(arm_on_output)

    reference = reference_run("adamw", world, 1, STEPS)
    for step in range(STEPS):
        if step == 1:  # a failed attempt at step 1, caught; the loop clears and retries the step
            tokens, targets, branch = next(rank_micro_batches(step, 1))
            armed.append(True)
            with pytest.raises(_Boom):
                model(tokens, targets, step, branch).backward()
            CLEARS[clear_name](model, opt)
        train_step(model, opt, step, 1, False)
        opt.step()
        opt.zero_grad()
    _compare(model, opt, reference[-1]["params"], groups)
    groups.destroy()
    return True


CLEARS = {
    "opt.zero_grad": lambda model, opt: opt.zero_grad(),
    "model.zero_grad": lambda model, opt: model.zero_grad(),
    # the next forward cleans up (a .grad left pointing into a reused staging buffer took another's gradient)
    "nothing": lambda model, opt: None,
    "zero_grad(set_to_none=False)": lambda model, opt: opt.zero_grad(set_to_none=False),
}


@pytest.mark.parametrize("clear", list(CLEARS))
@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_a_backward_that_raises_does_not_break_the_optimizer(clear, stage):
    assert_passes(_raising_backward, stage, clear)


# ---- what p.grad holds ---------------------------------------------------------------------------
def _stage0_grads_are_ddps(ep, use_no_sync):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=ep)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, 0)
    reference = reference_run("adamw", world, 2, 3)
    for step in range(3):
        train_step(model, opt, step, 2, use_no_sync)
        for name, p in model.named_parameters():  # right after backward, as DDP
            ref = reference[step]["grads"][name]
            if p.requires_grad:
                want = torch.zeros_like(p) if ref is None else local_reference_slice(name, p, ref)
                torch.testing.assert_close(p.grad, want, rtol=TOL, atol=1e-13, msg=lambda m: f"{name}: {m}")
        opt.step()
        opt.zero_grad()
    groups.destroy()
    return True


def test_stage0_grad_is_the_averaged_gradient_after_backward():
    for ep in (1, 2):
        for use_no_sync in (True, False):
            assert all(run_distributed(_stage0_grads_are_ddps, 2, ep, use_no_sync))


def _reassigned_between_synced_backwards():
    """`p.grad = p.grad.clone()` between two synced backwards changes nothing, for expert params (reduced over
    their ep group, so the average they show is rescaled before the next backward adds to it) too."""
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    _opt = _zero(model, groups, 0)  # the optimizer hooks the model; kept alive for the loop below
    reference = reference_run("adamw", world, 2, 1)
    for tokens, targets, branch in rank_micro_batches(0, 2):
        (model(tokens, targets, 0, branch) / 2).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad.clone()
    for name, p in model.named_parameters():
        ref = reference[0]["grads"][name]
        if ref is not None:
            torch.testing.assert_close(
                p.grad, local_reference_slice(name, p, ref), rtol=TOL, atol=1e-13, msg=lambda m: f"{name}: {m}"
            )
    groups.destroy()
    return True


def test_stage0_gradients_assigned_between_backwards_are_accumulated_on():
    assert all(run_distributed(_reassigned_between_synced_backwards, 2))


def _user_clipping_stage0():
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=1)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, 0)
    reference = reference_run("adamw", world, 2, STEPS, clip=0.05)
    for step in range(STEPS):
        train_step(model, opt, step, 2, False)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the DDP habit
        opt.step()
        opt.zero_grad()
    _compare(model, opt, reference[-1]["params"], groups)
    groups.destroy()
    return True


def test_clip_grad_norm_on_model_parameters_works_at_stage0():
    assert all(run_distributed(_user_clipping_stage0, 2))


def _clip_method(stage):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, stage)
    reference = reference_run("adamw", world, 2, STEPS, clip=0.05)
    for step in range(STEPS):
        train_step(model, opt, step, 2, False)
        norm = opt.clip_grad_norm_(0.05)  # the sharded replacement for torch.nn.utils.clip_grad_norm_
        assert abs(norm - reference[step]["norm"]) <= TOL * norm
        opt.step()
        opt.zero_grad()
    _compare(model, opt, reference[-1]["params"], groups)
    groups.destroy()
    return True


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_opt_clip_grad_norm_matches_torch_on_every_stage(stage):
    assert_passes(_clip_method, stage)


def _torch_clip_on_sharded_grads(stage):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) where .grad holds no values: one named error, never a
    silent 0.0; clearing and metadata still work, and opt.clip_grad_norm_ goes on from there."""
    groups = ParallelGroups.build(expert_parallel_size=1)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, stage)
    tokens, targets = micro_batch(0, dist.get_rank())
    model(tokens, targets, 0).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        outcome = "clipped"
    except GradientIsSharded as exc:
        outcome = str(exc)
    grad = model.embed.weight.grad
    assert grad.shape == model.embed.weight.shape and grad.dtype == torch.float64
    if stage > 0:
        assert "held as the optimizer's shards" in repr(grad)
        model.zero_grad(set_to_none=False)  # what stages 1-3 reduced stays (as documented); nothing raises
    assert opt.clip_grad_norm_(0.05) > 0 and opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    groups.destroy()
    return outcome


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_torch_clip_grad_norm_on_sharded_gradients_is_a_named_error(stage):
    for message in run_distributed(_torch_clip_on_sharded_grads, 2, stage):
        if stage == 0:
            assert message == "clipped"  # full gradients: torch's clip sees them (ep 1)
        else:
            assert "'embed.weight'" in message or "the gradient of '" in message, message
            assert "opt.clip_grad_norm_(max_norm)" in message, message


def _local_grads_under_no_sync(stage):
    rank = dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=1)
    model = ZeroTestModel(groups).double()
    opt = _zero(model, groups, stage)
    local = ZeroTestModel(ParallelGroups.single()).double()
    tokens, targets = micro_batch(0, rank)
    with opt.no_sync():
        model(tokens, targets, 0).backward()
    local(tokens, targets, 0).backward()
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        if stage >= 2:
            assert p.grad is None or isinstance(p.grad, ShardedGradient), name
        elif q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=1e-13, msg=lambda m: f"{name}: {m}")
    model(tokens, targets, 0).backward()
    assert stage == 0 or all(p.grad is None or isinstance(p.grad, ShardedGradient) for p in model.parameters())
    groups.destroy()
    return True


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_grads_under_no_sync_are_local_and_hidden_after_a_sharded_reduction(stage):
    assert_passes(_local_grads_under_no_sync, stage)


# ---- torch's defaults, master dtype per family, the param_groups forms torch takes ---------
def _torch_defaults(stage):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, grad_reduce_dtype=torch.float64, lr=0.05)
    assert all(g["weight_decay"] == 0.01 for g in opt.param_groups)  # torch's AdamW default
    reference = reference_run("adamw", world, 1, STEPS, make_opt=lambda m: torch.optim.AdamW(m.parameters(), lr=0.05))
    for step in range(STEPS):
        train_step(model, opt, step, 1, False)
        opt.step()
        opt.zero_grad()
    _compare(model, opt, reference[-1]["params"], groups)
    groups.destroy()
    return True


@pytest.mark.parametrize("stage", ZERO_STAGES[::2])
def test_inner_optimizer_defaults_are_torchs(stage):
    assert_passes(_torch_defaults, stage)


class _TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)  # fp32, registered first
        self.second = nn.Linear(4, 1).double()

    def forward(self, x):
        return self.second(self.first(x).double())


def test_master_dtype_is_per_family():
    torch.manual_seed(0)
    model, ref = _TwoDtypes(), _TwoDtypes()
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(model.second.weight, ref.second.weight)  # an fp32 master would round this


@pytest.mark.parametrize("form", ["tensor_list", "generator", "dict_with_tensor"])
def test_param_groups_in_the_forms_torch_accepts(form):
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 2).double(), nn.Linear(4, 2).double()
    ref.load_state_dict(model.state_dict())

    def groups_of(m):
        if form == "tensor_list":
            return [m.weight, m.bias]
        if form == "generator":
            return m.parameters()
        return [{"params": m.weight}, {"params": m.bias, "lr": 0.5}]

    opt = ZeroOptimizer(model, torch.optim.SGD, param_groups=groups_of(model), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(groups_of(ref), lr=0.1, momentum=0.9)
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)


def test_a_subset_of_params_trains_only_that_subset():
    torch.manual_seed(0)
    model, ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.SGD, param_groups=model[1].parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref[1].parameters(), lr=0.1)
    x = torch.randn(8, 4)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


# ---- the mistakes that used to train silently wrong -------------------------------------------
def test_fp16_with_plain_backward_says_to_use_opt_backward():
    model = nn.Linear(4, 1).half()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, loss_scaler=DynamicLossScaler(scale=1024.0))
    model(torch.ones(2, 4, dtype=torch.float16)).float().sum().backward()
    with pytest.raises(RuntimeError, match=r"opt\.backward\(loss\)"):
        opt.step()
    opt.zero_grad()
    opt.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum())
    before = model.weight.detach().clone()
    assert opt.step() and not torch.equal(before, model.weight)


def _groups_left_out():
    model = nn.Linear(4, 1)
    try:
        ZeroOptimizer(model, torch.optim.SGD, lr=0.1)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_groups_left_out_in_a_multi_rank_world_is_an_error():
    for message in run_distributed(_groups_left_out, 2):
        assert "groups=" in message and "ParallelGroups.build" in message


def test_step_consumes_the_gradients():
    """step() consumes the gradients: a loop that never calls zero_grad trains like one that does."""
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 1).double(), nn.Linear(4, 1).double()
    ref.load_state_dict(model.state_dict())
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.equal(model.weight, ref.weight)
    assert math.isfinite(opt.last_grad_norm)


class _LateBranch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.main, self.late = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def forward(self, x, step):
        return (self.late(self.main(x)) if step >= 2 else self.main(x)).square().mean()


def test_sgd_momentum_with_a_param_whose_first_gradient_comes_late():
    """torch's fused SGD fails once some params have momentum buffers and one gets its first gradient
    later; the default inner SGD must train like torch's."""
    model, ref = _LateBranch(), _LateBranch()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 4, dtype=torch.float64)
    for step in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x, step).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
