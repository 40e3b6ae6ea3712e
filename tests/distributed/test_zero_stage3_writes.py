"""Stage 3 writes persist and stop-gradient uses read the right values, at ep 1 and 2, like torch.

The field cases: an in-place write to a param inside forward (`w.clamp_()`, `nn.Embedding(max_norm=...)`)
or `load_state_dict` / `torch.nn.init` inside `opt.full_parameters()` landed in the gathered copy and was
lost; `h * fc.bias.detach()` or `h @ fc.weight.data.t()` before `fc(h)` crashed the backward (the unit was
freed once its params had their gradients). Each case trains against single-process torch in float64
(the reference runs every rank's batch; routed experts compared per rank's slice).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.keyed_random import init_keyed_
from moezero.moe import MoEConfig, MoELayer
from moezero.parallel import ParallelGroups
from moezero.zero import ZeroOptimizer
from tests.dist_utils import assert_replicas_equal, run_distributed
from tests.zero_model import Tower
from tests.zero_reference import local_reference_slice

TOL = 1e-10
WIDTH, VOCAB, STEPS = 8, 13, 3


class _Block(nn.Module):
    """Writes its weight in forward and uses its params through stop-gradient aliases before its own op."""

    def __init__(self, groups, layer_number, moe):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        config = MoEConfig(hidden_size=WIDTH, ffn_hidden_size=12, num_experts=4, top_k=2, aux_loss_coeff=0.0)
        self.moe = MoELayer(config, groups, layer_number=layer_number) if moe else None

    def forward(self, h):
        with torch.no_grad():
            self.fc.weight.clamp_(-0.2, 0.2)  # an in-place write in forward
        h = h + 0.5 * h * self.fc.bias.detach()  # read before fc's own op (SIGSEGV before)
        h = h + 0.1 * h @ self.fc.weight.data.t()  # through .data (out of bounds before)
        h = torch.tanh(self.fc(h))
        if self.moe is not None:
            y, _ = self.moe(h)
            h = h + y
        return h


class _Writer(nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, max_norm=1.0)  # torch renormalises looked-up rows in forward
        self.blocks = nn.ModuleList([_Block(groups, 1, moe=False), _Block(groups, 2, moe=True)])
        self.head = nn.Linear(WIDTH, VOCAB)
        init_keyed_(self, 3, lambda name, p: 0.6)
        self.double()

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _tokens(step):
    """The same tokens on every rank: a row renormalised by max_norm is renormalised everywhere (with other
    tokens per rank each replica would renormalise other rows, under torch DDP as under ZeRO)."""
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(step))


def _loss(model, step, rank):
    tokens = _tokens(step)
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(rank + 1, 1).reshape(-1))


def _reinit(model, step):
    """What a user does inside full_parameters(): load a state dict and re-init a module in place."""
    torch.manual_seed(77 + step)
    nn.init.normal_(model.blocks[1].fc.weight, std=0.1)
    state = {k: v.clone() for k, v in model.head.state_dict().items()}
    state["bias"] = torch.linspace(-0.3, 0.3, VOCAB, dtype=torch.float64)
    model.head.load_state_dict(state)


def _reference(world):
    model = _Writer(ParallelGroups.single())
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    params = []
    for step in range(STEPS):
        for r in range(world):  # one forward and backward per rank's batch (the writes break a shared graph)
            (_loss(model, step, r) / world).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            _reinit(model, step)
        params.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return params


def _writes_like_torch():
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = _reference(world)
    for stage in (0, 2, 3):
        for ep in (1, 2):
            groups = ParallelGroups.build(expert_parallel_size=ep)
            model = _Writer(groups)
            opt = ZeroOptimizer(
                model, torch.optim.AdamW, groups, stage=stage, lr=0.02, bucket_size=64, grad_reduce_dtype=torch.float64
            )
            for step in range(STEPS):
                _loss(model, step, rank).backward()
                opt.step()
                opt.zero_grad()
                if step == 1:
                    with opt.full_parameters():
                        _reinit(model, step)
            with opt.full_parameters():
                for name, p in model.named_parameters():
                    want = local_reference_slice(name, p, reference[-1][name])
                    torch.testing.assert_close(
                        p.detach(), want, rtol=TOL, atol=1e-13, msg=lambda m: f"stage {stage}, ep {ep}, {name}: {m}"
                    )
                assert_replicas_equal(model, groups)
            groups.destroy()
    return True


def test_writes_in_forward_and_inside_full_parameters_persist_like_torch():
    assert all(run_distributed(_writes_like_torch, 2))


def _one_rank_writes():
    """modifier_rank: only rank 1 writes (loads a checkpoint, say), every rank trains on its values (DeepSpeed's
    GatheredParameters(modifier_rank=...)). At ep 2 each rank holds other experts: rank 1's own experts take its
    write, rank 0's stay as they were (no rank of their replica group wrote them)."""
    rank = dist.get_rank()
    for stage in (1, 3):
        groups = ParallelGroups.build(expert_parallel_size=2)
        model, fresh = _Writer(groups), _Writer(groups)
        opt = ZeroOptimizer(
            model, torch.optim.AdamW, groups, stage=stage, lr=0.02, bucket_size=64, grad_reduce_dtype=torch.float64
        )
        with opt.full_parameters(modifier_rank=1):
            if rank == 1:
                with torch.no_grad():
                    model.head.bias.fill_(0.25)
                    for p in model.blocks[1].moe.parameters():
                        p.mul_(2.0)
        with opt.full_parameters():
            for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
                doubled = name.startswith("blocks.1.moe.") and ("experts" not in name or rank == 1)
                want = torch.full_like(q, 0.25) if name == "head.bias" else q.detach() * (2.0 if doubled else 1.0)
                torch.testing.assert_close(p.detach(), want, rtol=0, atol=0, msg=lambda m: f"{stage} {name}: {m}")
            assert_replicas_equal(model, groups)
        groups.destroy()
    return True


def test_full_parameters_with_a_modifier_rank_gives_every_rank_its_values():
    assert all(run_distributed(_one_rank_writes, 2))


def _grads_and_evals_like_torch():
    """torch.autograd.grad w.r.t. params and eval forwards between steps (stop-gradient uses inside) at stage 3:
    torch's numbers, and the training that follows is torch's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model, ref = _Writer(groups), _Writer(ParallelGroups.single())
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, groups, stage=3, lr=0.02, bucket_size=64, grad_reduce_dtype=torch.float64
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    for step in range(2):
        w, ref_w = model.blocks[0].fc.weight, ref.blocks[0].fc.weight
        (grad,) = torch.autograd.grad(_loss(model, step, rank), [w])
        (ref_grad,) = torch.autograd.grad(_loss(ref, step, rank), [ref_w])
        torch.testing.assert_close(grad, ref_grad, rtol=TOL, atol=1e-13)
        model.eval(), ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(_tokens(7)), ref(_tokens(7)), rtol=TOL, atol=1e-12)
        model.train(), ref.train()
        _loss(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
        for r in range(world):
            (_loss(ref, step, r) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with opt.full_parameters():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.detach(),
                local_reference_slice(name, p, q.detach()),
                rtol=TOL,
                atol=1e-13,
                msg=lambda m: f"{name}: {m}",
            )
    groups.destroy()
    return True


def test_autograd_grad_and_eval_forwards_between_steps_are_torchs():
    assert all(run_distributed(_grads_and_evals_like_torch, 2))


WRITES_OUTSIDE_THE_SCHEDULE = (
    "between forward and backward",
    "in the root's forward, before the block",
    "after a forward whose output was dropped",
)


def _train_with_writes(model, opt, where):
    for step in range(2):
        tokens = _tokens(step)
        forward = lambda: F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))  # noqa: E731
        if where == "between forward and backward":  # the last block stays gathered for the backward
            loss = forward()
            with torch.no_grad():
                model.blocks[2].bias.add_(0.5)  # torch keeps it: a linear's bias is not saved for backward
            loss.backward()
        elif where == "after a forward whose output was dropped":  # an eval that forgot no_grad
            model(_tokens(9))
            with torch.no_grad():
                nn.init.constant_(model.blocks[2].bias, 0.25)
            forward().backward()
        else:
            forward().backward()
        opt.step()
        opt.zero_grad()


def _writes_outside_the_schedule_like_torch():
    """Writes to a unit the schedule holds gathered without exposing it (an on-demand gather, the last block kept
    for backward) reached only the gathered copy and were lost when it was freed, silently."""
    for where in WRITES_OUTSIDE_THE_SCHEDULE:
        root_writes = where.startswith("in the root")
        ref = Tower(WIDTH, VOCAB, write_block_in_root=root_writes)
        _train_with_writes(ref, torch.optim.AdamW(ref.parameters(), lr=0.05), where)
        groups = ParallelGroups.build()
        model = Tower(WIDTH, VOCAB, write_block_in_root=root_writes)
        opt = ZeroOptimizer(
            model,
            torch.optim.AdamW,
            groups,
            stage=3,
            lr=0.05,
            bucket_size=64,
            grad_reduce_dtype=torch.float64,
            min_unit_params=0,
        )
        _train_with_writes(model, opt, where)
        with opt.full_parameters():
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(
                    p.detach(), q.detach(), rtol=TOL, atol=1e-13, msg=lambda m: f"{where}, {name}: {m}"
                )
        groups.destroy()
    return True


def test_writes_to_a_unit_gathered_outside_the_schedule_persist_like_torch():
    assert all(run_distributed(_writes_outside_the_schedule_like_torch, 2))
