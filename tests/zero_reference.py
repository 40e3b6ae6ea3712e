"""Single-process PyTorch references and the matching N-rank loop for the ZeRO tests.

The reference trains `ZeroTestModel` (all experts in one process) on every global micro-batch of
a step in order, with a plain torch optimizer; the N-rank loop runs micro-batch j * world + rank
on rank r, exactly as a user's data-parallel loop does. Both normalise the loss per step the
same way (the optimizer averages over ranks), so they must agree.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups, expert_shard_of
from tests.dist_utils import run_distributed
from tests.zero_model import ZeroTestModel, micro_batch, uses_rank0_branch

ZERO_STAGES = (0, 1, 2, 3)  # every stage the tests run


def assert_passes(worker: Callable, stage: int, *args, world: int = 2) -> None:
    """Runs `worker(stage, *args)` on `world` gloo ranks; every rank must return True. Tests parametrize
    `stage` over ZERO_STAGES, so each stage reports on its own."""
    assert all(run_distributed(worker, world, stage, *args)), f"stage {stage}"


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))),
    "sgd": (torch.optim.SGD, dict(lr=0.2, momentum=0.9, weight_decay=0.1)),
}


def reference_run(
    optimizer: str,
    world: int,
    accumulation: int,
    steps: int,
    clip: Optional[float] = None,
    dtype=torch.float64,
    model_kwargs=None,
    make_opt: Optional[Callable] = None,
    each_step: Optional[Callable] = None,
) -> List[dict]:
    """Per step: the averaged gradients torch computed, the grad norm and the params after the step."""
    model = ZeroTestModel(ParallelGroups.single(), **(model_kwargs or {})).to(dtype)
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = make_opt(model) if make_opt else cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    history = []
    for step in range(steps):
        if each_step is not None:
            each_step(step, model, opt)
        n = world * accumulation
        for index in range(n):
            tokens, targets = micro_batch(step, index)
            (model(tokens, targets, step, uses_rank0_branch(index, world)) / n).backward()
        grads = {name: (p.grad.clone() if p.grad is not None else None) for name, p in model.named_parameters()}
        trainable = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(trainable, clip if clip else float("inf")).item()
        opt.step()
        opt.zero_grad()
        history.append({"grads": grads, "norm": norm, "params": detached_params(model)})
    return history


def detached_params(model) -> Dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def rank_micro_batches(step: int, accumulation: int):
    """(tokens, targets, rank0_branch) of this rank's micro-batches of `step`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for micro in range(accumulation):
        index = micro * world + rank
        tokens, targets = micro_batch(step, index)
        yield tokens, targets, uses_rank0_branch(index, world)


def train_step(model, opt, step: int, accumulation: int, use_no_sync: bool) -> None:
    """One optimizer step of a plain data-parallel loop (`loss.backward()` per micro-batch)."""
    for micro, (tokens, targets, branch) in enumerate(rank_micro_batches(step, accumulation)):
        last = micro == accumulation - 1
        with opt.no_sync() if use_no_sync and not last else contextlib.nullcontext():
            (model(tokens, targets, step, branch) / accumulation).backward()


def assert_params_match(model, expected: Dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    """Local params against the reference's (routed experts: this rank's slice of the global stack)."""
    for name, p in model.named_parameters():
        want = expected[name]
        shard = expert_shard_of(p)
        if shard is not None:
            want = want[shard.first_global_expert : shard.first_global_expert + shard.num_local_experts]
        torch.testing.assert_close(p.detach(), want.to(p.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def local_reference_slice(name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    shard = expert_shard_of(p)
    if shard is None:
        return full
    return full[shard.first_global_expert : shard.first_global_expert + shard.num_local_experts]
