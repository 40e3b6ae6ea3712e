"""ZeRO behaviour beyond exactness: memory, fp16 overflow, bf16, integrity errors."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import profile

from moezero.moe.router import TopKRouter
from moezero.parallel import ParallelGroups
from moezero.zero import DynamicLossScaler, GradientHookError, ParameterSetChanged, ZeroOptimizer
from moezero.zero.param_groups import default_param_groups
from tests.dist_utils import assert_replicas_equal, run_distributed
from tests.zero_model import ZeroTestModel, micro_batch


# ---- stage 2 gradient memory --------------------------------------------------------------------
def _peak_bytes(prof) -> int:
    """Peak of the running sum of CPU allocations recorded by the profiler."""
    events = []
    for e in prof.events():
        delta = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if delta:
            events.append((e.time_range.start, delta))
    current = peak = 0
    for _, delta in sorted(events):
        current += delta
        peak = max(peak, current)
    return peak


def _wide_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])


def _peaks_for(stage, bucket_size):
    """(peak over construction + a first step, peak inside a second backward alone)."""
    groups = ParallelGroups.build()
    model = _wide_model()
    x = torch.randn(2, 256)
    with profile(profile_memory=True) as first_step:
        opt = ZeroOptimizer(model, torch.optim.SGD, groups, stage=stage, bucket_size=bucket_size, lr=0.1,
                            momentum=0.9)
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    loss = model(x).square().sum()
    with profile(profile_memory=True) as backward:
        loss.backward()
    assert stage != 2 or all(p.grad is None for p in model.parameters())
    opt.step()
    groups.destroy()
    return _peak_bytes(first_step), _peak_bytes(backward)


def _memory_by_stage():
    numel = sum(p.numel() for p in _wide_model().parameters())
    small = numel // 16
    return numel, _peaks_for(1, small), _peaks_for(2, small), _peaks_for(2, numel)


def test_stage2_drops_the_full_gradient_buffer():
    numel, stage1, stage2, stage2_one_bucket = run_distributed(_memory_by_stage, 2, fresh=True)[0]
    grad_bytes = 4 * numel
    # stage 1 keeps a full fp32 gradient buffer; stage 2 keeps only its shard and in-flight buckets
    assert stage1[0] - stage2[0] >= 0.5 * grad_bytes, (stage1, stage2, grad_bytes)
    # inside backward, stage 2 holds only the gradients of in-flight buckets: with one bucket every
    # gradient waits for it (and for its full-size staging copy)
    assert stage2[1] < 0.5 * stage2_one_bucket[1], (stage2, stage2_one_bucket)
    assert stage2_one_bucket[1] - stage2[1] >= 0.75 * grad_bytes, (stage2_one_bucket, stage2, grad_bytes)


# ---- fp16: an inf on one rank skips the step everywhere and halves the scale ----------------------
def _fp16_overflow():
    rank = dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).half()
    scaler = DynamicLossScaler(scale=1024.0, hysteresis=1)
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=2, lr=1e-3, loss_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    tokens, targets = micro_batch(0, rank)
    loss = model(tokens, targets, 0)
    if rank == 1:
        loss = loss + model.twice.weight.sum() * float("inf")  # an inf gradient on rank 1 only
    opt.backward(loss)
    stepped = opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    result = (stepped, scaler.scale, opt.skipped_steps, unchanged)
    opt.backward(model(tokens, targets, 1))  # a clean step afterwards works
    result += (opt.step(),)
    groups.destroy()
    return result


def test_fp16_overflow_on_one_rank_skips_everywhere():
    for stepped, scale, skipped, unchanged, next_stepped in run_distributed(_fp16_overflow, 2):
        assert (stepped, scale, skipped, unchanged, next_stepped) == (False, 512.0, 1, True, True)


def test_repeated_non_finite_steps_fail_the_run():
    model = nn.Linear(4, 1)
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, max_skipped_steps=3)
    for step in range(2):
        (model(torch.ones(1, 4)) * float("nan")).sum().backward()
        assert opt.step() is False
    (model(torch.ones(1, 4)) * float("nan")).sum().backward()
    with pytest.raises(FloatingPointError, match="3 consecutive steps"):
        opt.step()


# ---- bf16 against a single-process reference with fp32 master weights ---------------------------
BF16_STEPS = 4


def _bf16_reference():
    model = ZeroTestModel(ParallelGroups.single()).bfloat16()
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in model.named_parameters()
               if p.requires_grad}
    by_id = {id(p): n for n, p in model.named_parameters()}
    groups = [{**g, "params": [masters[by_id[id(p)]] for p in g["params"]]}
              for g in default_param_groups(model, 0.1)]
    opt = torch.optim.AdamW(groups, lr=0.02, weight_decay=0.1)
    losses = []
    for step in range(BF16_STEPS):
        grads = {n: torch.zeros_like(m) for n, m in masters.items()}
        seen = set()
        step_loss = 0.0
        for index in range(4):  # 2 ranks x 2 micro-steps
            tokens, targets = micro_batch(step, index)
            loss = model(tokens, targets, step) / 4
            loss.backward()
            step_loss += loss.item()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    grads[n] += p.grad.float()
                    seen.add(n)
                    p.grad = None
        for n, m in masters.items():
            m.grad = grads[n] if n in seen else None
        torch.nn.utils.clip_grad_norm_([m for m in masters.values() if m.grad is not None], 0.5)
        opt.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in masters:
                    p.copy_(masters[n])
        losses.append(step_loss)
    return losses, {n: p.detach().float() for n, p in model.named_parameters()}


def _bf16_zero(stage):
    rank = dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).bfloat16()
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, clip_grad=0.5, lr=0.02, weight_decay=0.1,
                        bucket_size=200)
    gate_before = model.moe1.router.wg.weight.detach().clone()
    losses = []
    for step in range(BF16_STEPS):
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(2):
            tokens, targets = micro_batch(step, micro * 2 + rank)
            with opt.no_sync() if micro == 0 else _Nothing():
                loss = model(tokens, targets, step) / 2
                loss.backward()
            total += loss.detach().double() / 2
        dist.all_reduce(total)
        losses.append(total.item())
        opt.step()
        opt.zero_grad()
    assert not torch.equal(model.moe1.router.wg.weight, gate_before), "the gate must train"
    assert opt.counters.fires["moe1.router.wg.weight"] == 2 * BF16_STEPS
    assert_replicas_equal(model, groups)
    params = {n: p.detach().float() for n, p in model.named_parameters()}
    groups.destroy()
    return losses, params


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _bf16_all_stages():
    return [_bf16_zero(stage) for stage in (0, 1, 2)], _bf16_reference()


def test_bf16_tracks_a_single_process_fp32_master_reference():
    """Tolerance: bf16 forward passes match until an fp32 summation-order difference in the gradient
    flips one bf16 rounding; after 4 AdamW steps (lr 0.02) losses agree within 5e-3 and every
    param tensor within 2e-2 relative L2 (measured: 1.2e-3 and 7.4e-3). Stages agree to 1e-6."""
    results = run_distributed(_bf16_all_stages, 2, timeout=300)
    for rank, (per_stage, (ref_losses, ref_params)) in enumerate(results):
        stage0_losses = per_stage[0][0]
        for losses, params in per_stage:
            assert max(abs(a - b) for a, b in zip(losses, stage0_losses)) < 1e-6
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 5e-3, (losses, ref_losses)
            for name, value in params.items():
                expected = ref_params[name]
                if ".experts." in name:
                    expected = expected[rank * 4:rank * 4 + 4]  # ep 2 on 2 ranks: rank r holds experts 4r..4r+3
                relative = ((value - expected).norm() / expected.norm()).item()
                assert relative < 2e-2, (name, relative)


# ---- integrity errors ------------------------------------------------------------------------------
class _CastingRouter(TopKRouter):
    """The historical bug: the gate module is cast to fp32 inside forward."""

    def forward(self, x_TD, *args, **kwargs):
        self.wg.float()
        return super().forward(x_TD.float(), *args, **kwargs)


def _casting_gate_fails():
    groups = ParallelGroups.build()
    model = ZeroTestModel(groups).bfloat16()
    model.moe1.router.__class__ = _CastingRouter
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=2, lr=1e-3)
    tokens, targets = micro_batch(0, dist.get_rank())
    try:
        model(tokens, targets, 0).backward()
    except GradientHookError as exc:
        message = str(exc)
    else:
        message = "no error"
    groups.destroy()
    del opt
    return message


def test_a_gate_cast_in_forward_is_an_error_naming_the_param():
    for message in run_distributed(_casting_gate_fails, 2):
        assert "'moe1.router.wg.weight' no longer lives in the optimizer's buffer" in message


def _model_and_opt(stage=2):
    model = ZeroTestModel(ParallelGroups.single()).double()
    return model, ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-3)


def test_reentrant_checkpointing_is_an_error():
    model, opt = _model_and_opt()
    tokens, targets = micro_batch(0, 0)

    def forward(tokens):
        x = model.embed(tokens)
        x = torch.utils.checkpoint.checkpoint(model.block, x, use_reentrant=True)
        return model.norm(model.moe1(x)[0] + model.twice(x)).square().sum()
    with pytest.raises(GradientHookError, match="use_reentrant=False"):
        forward(tokens).backward()


def test_frozen_or_new_params_after_construction_are_errors():
    model, opt = _model_and_opt()
    model.data_branch.weight.requires_grad_(False)
    with pytest.raises(ParameterSetChanged, match="'data_branch.weight' was frozen"):
        opt.step()
    model, opt = _model_and_opt()
    model.frozen.weight.requires_grad_(True)
    with pytest.raises(ParameterSetChanged, match="'frozen.weight' is trainable"):
        opt.step()
    model, opt = _model_and_opt()
    model.twice = nn.Linear(8, 8).double()  # a module swapped in after init
    with pytest.raises(ParameterSetChanged, match="'twice.weight'"):
        opt.step()


def test_only_elementwise_optimizers():
    with pytest.raises(ValueError, match="LBFGS.*element-wise"):
        ZeroOptimizer(nn.Linear(2, 2), torch.optim.LBFGS)
    with pytest.raises(ValueError, match="SparseAdam"):
        ZeroOptimizer(nn.Linear(2, 2), torch.optim.SparseAdam)

