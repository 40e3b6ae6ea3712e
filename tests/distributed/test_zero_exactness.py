"""The central test: N ranks of ZeRO 0/1/2 reproduce single-process PyTorch on the same global batch.

float64 on the reference path, so agreement is ~1e-12. Compared every step: the reduced gradient
of every element this rank owns, the global grad norm (clipping engaged), and all parameters.
AdamW alone would hide a constant gradient-scale bug, so SGD with momentum runs too.
"""
import copy
import itertools

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups, comm, expert_shard_of
from moezero.zero import ZeroOptimizer
from moezero.zero.param_groups import default_param_groups
from moezero.zero.state import global_placement, owned_gradient_pieces
from tests.dist_utils import assert_replicas_equal, run_distributed
from tests.zero_model import ZeroTestModel, micro_batch

STEPS, CLIP, TOL = 5, 0.05, 1e-10
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))),
    "sgd": (torch.optim.SGD, dict(lr=0.2, momentum=0.9, weight_decay=0.1)),
}


def _reference_run(optimizer, world, accumulation):
    """Single process, all experts, every global micro-batch in order: grads, norms and params per step."""
    model = ZeroTestModel(ParallelGroups.single()).double()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(default_param_groups(model, kwargs["weight_decay"]), **kwargs)
    micro_batches = world * accumulation
    history = []
    for step in range(STEPS):
        for index in range(micro_batches):
            tokens, targets = micro_batch(step, index)
            (model(tokens, targets, step) / micro_batches).backward()
        grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        opt.step()
        opt.zero_grad()
        history.append((grads, norm.item(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    return history


def _check_config(ep, stage, accumulation, optimizer, use_no_sync, references):
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=ep)
    model = ZeroTestModel(groups).double()
    frozen_before = model.frozen.weight.detach().clone()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = ZeroOptimizer(model, cls, groups, stage=stage, bucket_size=150, clip_grad=CLIP,
                        grad_reduce_dtype=torch.float64, **kwargs)
    reference = references[(optimizer, accumulation)]
    for step in range(STEPS):
        for micro in range(accumulation):
            tokens, targets = micro_batch(step, micro * world + rank)
            last = micro == accumulation - 1
            with (opt.no_sync() if use_no_sync and not last else _nothing()):
                (model(tokens, targets, step) / accumulation).backward()
        if stage == 2:
            assert all(p.grad is None for p in model.parameters()), "stage 2 keeps no full gradients"
        opt.reduce_gradients()
        ref_grads, ref_norm, ref_params = reference[step]
        _compare_owned_grads(opt, ref_grads)
        opt.step()
        opt.zero_grad()
        assert abs(opt.last_grad_norm - ref_norm) <= TOL * ref_norm, (opt.last_grad_norm, ref_norm)
        assert ref_norm > CLIP  # clipping engaged
        _compare_params(model, ref_params)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert opt.counters.fires.get(name, 0) + opt.counters.zero_fills.get(name, 0) == STEPS * accumulation
    assert opt.counters.zero_fills.get("odd_step_branch.weight", 0) >= (STEPS // 2) * accumulation
    assert torch.equal(model.frozen.weight, frozen_before)
    assert_replicas_equal(model, groups)
    groups.destroy()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _compare_owned_grads(opt, ref_grads):
    for name, pieces in owned_gradient_pieces(opt).items():
        ref = ref_grads[name]
        ref_flat = torch.zeros(0) if ref is None else ref.reshape(-1)
        for (lo, hi), grad in pieces:
            expected = torch.zeros_like(grad) if ref is None else ref_flat[lo:hi]
            torch.testing.assert_close(grad, expected, rtol=TOL, atol=1e-13, msg=lambda m: f"{name} grad: {m}")


def _compare_params(model, ref_params):
    for name, p in model.named_parameters():
        expected = ref_params[name]
        shard = expert_shard_of(p)
        if shard is not None:
            expected = expected[shard.first_global_expert:shard.first_global_expert + shard.num_local_experts]
        torch.testing.assert_close(p.detach(), expected, rtol=TOL, atol=1e-13, msg=lambda m: f"{name}: {m}")


def _matrix():
    world = dist.get_world_size()
    references = {(o, a): _reference_run(o, world, a) for o in OPTIMIZERS for a in (1, 4)}
    done = []
    for ep, stage, accumulation, optimizer in itertools.product((1, 2), (0, 1, 2), (1, 4), OPTIMIZERS):
        use_no_sync = optimizer == "adamw"  # sgd runs accumulate without no_sync (reduce every backward)
        try:
            _check_config(ep, stage, accumulation, optimizer, use_no_sync, references)
        except AssertionError as exc:
            raise AssertionError(f"ep={ep} stage={stage} accumulation={accumulation} {optimizer}: {exc}") from None
        done.append((ep, stage, accumulation, optimizer))
    return len(done)


def test_exactness_matrix_two_ranks():
    assert run_distributed(_matrix, 2, timeout=600) == [24, 24]


def test_exactness_matrix_four_ranks():
    assert run_distributed(_matrix, 4, timeout=900) == [24] * 4
