"""PrecisionAwareAdam under ZeRO (Megatron's --use-precision-aware-optimizer), 2 ranks, every stage, ep 1 and 2.

The oracle is ZeroOptimizer with torch's AdamW on the same model and data, whose moments are rounded to the narrow
dtype after each step by hand: fp32 params (their own masters) must match bitwise at every step. bf16 params keep
their fp32 masters as param + remainder: the first step's masters match the AdamW run's fp32 copies bitwise. A
checkpoint taken at one stage resumes at another bit-exactly, and loads into plain AdamW. The optimizer holds
no fp32 copy: 2 + 2 bytes of moments and 2 of remainder per element it owns."""

import gc

import pytest
import torch
from torch import nn

from moezero.parallel import ParallelGroups
from moezero.zero import PrecisionAwareAdam, ZeroOptimizer, consolidate
from tests.dist_utils import run_distributed
from tests.heap import heap_bytes
from tests.zero_model import ZeroTestModel
from tests.zero_reference import ZERO_STAGES, train_step

HYPER = dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))
NARROW = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
STEPS = 4


def _round_moments(opt) -> None:
    for state in opt.inner.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            state[key].copy_(state[key].to(torch.bfloat16))


def _masters(opt):
    """{(name, global range): fp32 master values} this rank holds."""
    values = getattr(opt.inner, "master_values", lambda leaf: leaf.detach())
    return {
        (piece.param.name, piece.global_range(slice(0, piece.master.numel()))): values(piece.master).clone()
        for piece in opt.engine.master_pieces()
    }


def _pair(groups, stage, dtype, **narrow):
    ours_model, theirs_model = (ZeroTestModel(groups).to(dtype) for _ in range(2))
    ours = ZeroOptimizer(ours_model, PrecisionAwareAdam, groups, stage=stage, bucket_size=150, **narrow, **HYPER)
    theirs = ZeroOptimizer(theirs_model, torch.optim.AdamW, groups, stage=stage, bucket_size=150, **HYPER)
    return (ours_model, ours), (theirs_model, theirs)


def _fp32_params_match_rounded_adamw(stage):
    ok = True
    for ep in (1, 2):
        groups = ParallelGroups.build(expert_parallel_size=ep)
        (model, opt), (ref_model, ref) = _pair(groups, stage, torch.float32, **NARROW)
        for step in range(STEPS):
            for m, o in ((model, opt), (ref_model, ref)):
                train_step(m, o, step, 2, use_no_sync=False)
                o.step()
                o.zero_grad()
            _round_moments(ref)
            ours, theirs = _masters(opt), _masters(ref)
            ok &= ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
            ok &= opt.params_norm() == ref.params_norm()
    return ok


def _bf16_masters_match_then_resume_elsewhere(stage):
    groups = ParallelGroups.build(expert_parallel_size=2)
    (model, opt), (ref_model, ref) = _pair(groups, stage, torch.bfloat16, main_grads_dtype=torch.float32, **NARROW)
    for m, o in ((model, opt), (ref_model, ref)):
        train_step(m, o, 0, 2, use_no_sync=False)
        o.step()
    ours, theirs = _masters(opt), _masters(ref)
    first_step_equal = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    memory = opt.memory_bytes()
    owned = sum(p.owned.stop - p.owned.start for p in opt.engine.master_pieces() if p.param.family.trainable)
    compact = memory["master"] == 0 and memory["optimizer_state"] <= 6 * owned + 64 * len(opt.inner.state)
    shard = opt.state_dict()
    for step in range(1, 3):
        train_step(model, opt, step, 2, use_no_sync=False)
        opt.step()
    with opt.full_parameters():
        straight = [p.detach().clone() for p in model.parameters()]
    # resume the step-1 state at another stage, and in plain AdamW (fp32 copies of the same masters)
    full = consolidate([s for s in _all_gather(shard)])
    other = 3 if stage != 3 else 1
    again_model = ZeroTestModel(groups).to(torch.bfloat16)
    again = ZeroOptimizer(
        again_model,
        PrecisionAwareAdam,
        groups,
        stage=other,
        bucket_size=999,
        main_grads_dtype=torch.float32,
        **NARROW,
        **HYPER,
    )
    again.load_state_dict(full)
    for step in range(1, 3):
        train_step(again_model, again, step, 2, use_no_sync=False)
        again.step()
    with again.full_parameters():
        resumed = all(torch.equal(a, b) for a, b in zip(again_model.parameters(), straight))
    plain_model = ZeroTestModel(groups).to(torch.bfloat16)
    plain = ZeroOptimizer(plain_model, torch.optim.AdamW, groups, stage=stage, bucket_size=150, **HYPER)
    plain.load_state_dict(full)
    plain_loads = all(torch.equal(a, b) for a, b in zip(_masters(plain).values(), _masters(ref).values()))
    return {"first step": first_step_equal, "compact": compact, "resumed": resumed, "plain AdamW loads": plain_loads}


def _all_gather(shard):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, shard)
    return out


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_fp32_params_equal_adamw_with_rounded_moments(stage):
    assert all(run_distributed(_fp32_params_match_rounded_adamw, 2, stage))


@pytest.mark.parametrize("stage", (1, 3))
def test_bf16_masters_exact_and_checkpoint_moves(stage):
    for result in run_distributed(_bf16_masters_match_then_resume_elsewhere, 2, stage):
        assert all(result.values()), result


def _one_step(stage, grads_dtype):
    """A bf16 model after one step whose gradients are reduced and handed to Adam in `grads_dtype`: the params
    before and after (full), and the bytes the gradients hold."""
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).to(torch.bfloat16)
    opt = ZeroOptimizer(
        model,
        PrecisionAwareAdam,
        groups,
        stage=stage,
        grad_reduce_dtype=grads_dtype,
        main_grads_dtype=grads_dtype,
        **NARROW,
        **HYPER,
    )
    with opt.full_parameters():
        before = [p.detach().clone() for p in model.parameters()]
    train_step(model, opt, 0, 2, use_no_sync=False)
    opt.step()
    with opt.full_parameters():
        after = [p.detach().clone() for p in model.parameters()]
    return before, after, opt.memory_bytes()["grads"]


def _bf16_main_grads(stage):
    """bf16 main grads train (most params move, none goes non-finite) and the gradients hold less (the
    accumulated shard is bf16; the staging buffers are the params' dtype either way)."""
    before, after, grads_bytes = _one_step(stage, torch.bfloat16)
    fp32_grads_bytes = _one_step(stage, torch.float32)[2]
    moved = sum(not torch.equal(a, b) for a, b in zip(before, after))
    finite = all(bool(p.isfinite().all()) for p in after)
    return moved >= len(before) // 2 and finite and grads_bytes < fp32_grads_bytes


@pytest.mark.parametrize("stage", (2, 3))
def test_bf16_main_grads_train(stage):
    assert all(run_distributed(_bf16_main_grads, 2, stage))


def test_bf16_main_grads_need_an_optimizer_with_its_own_masters():
    with pytest.raises(ValueError, match="main_grads_dtype=torch.bfloat16 needs an optimizer"):
        ZeroOptimizer(torch.nn.Linear(2, 2), torch.optim.AdamW, main_grads_dtype=torch.bfloat16)


# ---- memory per param, measured on the process heap ------------------------------------------------------------
def heap_bytes_per_param(make_optimizer, layers: int = 8, width: int = 512) -> float:
    """Bytes the process heap holds per param once a bf16 model trained one step under `make_optimizer(model)`:
    the params, gradients, masters and moments (one rank, so nothing is sharded)."""
    torch.manual_seed(0)
    gc.collect()
    gc.disable()  # a collection inside the window would free earlier garbage
    try:
        before = heap_bytes()
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(torch.bfloat16)
        opt = make_optimizer(model)
        model(torch.randn(2, width, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        added = heap_bytes() - before
    finally:
        gc.enable()
    return added / sum(p.numel() for p in model.parameters())


def adamw_fp32_state(model):
    return ZeroOptimizer(model, torch.optim.AdamW, ParallelGroups.single(), stage=1, lr=1e-3)


def precision_aware_bf16(model):
    return ZeroOptimizer(
        model,
        PrecisionAwareAdam,
        ParallelGroups.single(),
        stage=1,
        lr=1e-3,
        grad_reduce_dtype=torch.bfloat16,
        main_grads_dtype=torch.bfloat16,
        **NARROW,
    )


def test_bytes_per_param_on_the_heap():
    """bf16 params, stage 1 on one rank (its shard is everything): AdamW holds 2 (param) + 4 + 4 (the fp32 grad
    buffer and reduced shard) + 4 (fp32 master) + 8 (fp32 moments) = 22 bytes a param; bf16 main grads, bf16
    moments and the master as param + remainder: 2 + 2 + 2 + 2 + 4 = 12 (at dp N: 4 + 8 / N, against 6 + 16 / N)."""
    heap_bytes_per_param(adamw_fp32_state, layers=1)  # warm up one-time allocations
    assert 21.5 <= heap_bytes_per_param(adamw_fp32_state) <= 22.5
    assert 11.5 <= heap_bytes_per_param(precision_aware_bf16) <= 12.5
