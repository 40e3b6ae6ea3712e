"""Loops a torch user writes, off stage 3's happy path: each trains as single-process torch (float64, 2 gloo ranks;
stage 2 as the control) or raises one line on every rank, never a crash or a hang.

A segfault or a hang is a test of its own, in a world of its own that is killed afterwards (`isolated=True`).
"""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.keyed_random import init_keyed_
from moezero.moe import MoEConfig, MoELayer
from moezero.parallel import ParallelGroups, is_expert_parallel
from moezero.zero import ZeroOptimizer
from tests.dist_utils import assert_replicas_equal, run_distributed
from tests.zero_reference import local_reference_slice

TOL = 1e-10
WIDTH, VOCAB = 8, 13


class _Block(nn.Module):
    """A linear block, with an MoE layer (`moe`); `clamp_data`: clamps its weight through `.data` in forward."""

    def __init__(self, groups, layer_number, moe):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        config = MoEConfig(hidden_size=WIDTH, ffn_hidden_size=12, num_experts=4, top_k=2, aux_loss_coeff=0.0)
        self.moe = MoELayer(config, groups, layer_number=layer_number) if moe else None
        self.clamp_data = False

    def forward(self, h):
        if self.clamp_data:
            self.fc.weight.data.clamp_(-0.25, 0.25)
        h = torch.tanh(self.fc(h))
        if self.moe is not None:
            y, _ = self.moe(h)
            h = h + y
        return h


class _Net(nn.Module):
    """An embedding and a head at the root, blocks in a ModuleList (stage-3 units); `skip`: blocks this forward
    leaves out (LayerDrop); `zero_padding_row`: zeroes the embedding's row 0 through `.data` in forward."""

    def __init__(self, groups, moe=(False, True, False)):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(_Block(groups, i + 1, m) for i, m in enumerate(moe))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.skip = set()
        self.zero_padding_row = False
        init_keyed_(self, 3, lambda name, p: 0.5)  # the same values for any ep
        self.double()

    def forward(self, tokens):
        if self.zero_padding_row:
            self.emb.weight.data[0].zero_()
        h = self.embedded = self.emb(tokens)  # kept: a gradient penalty differentiates with respect to it
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                h = block(h)
        return self.head(h)


def _tokens(step, rank):
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(31 * step + rank))


def _loss(model, step, rank):
    tokens = _tokens(step, rank)
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.roll(1, 1).reshape(-1))


def _zero(model, groups, stage, **options):
    return ZeroOptimizer(
        model,
        torch.optim.AdamW,
        groups,
        stage=stage,
        lr=0.02,
        bucket_size=64,
        grad_reduce_dtype=torch.float64,
        **options,
    )


def _assert_like(model, opt, ref, groups, what):
    with opt.full_parameters():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(
                p.detach(),
                local_reference_slice(name, p, q.detach()),
                rtol=TOL,
                atol=1e-13,
                msg=lambda m: f"{what}, {name}: {m}",
            )
        assert_replicas_equal(model, groups)


def _train_like_torch(loop, stage, ep, steps=3, make=_Net, **options):
    """`loop(model, opt, step, rank, scale)` on this rank's batch, against torch running every rank's in turn."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=ep, timeout=datetime.timedelta(seconds=30))
    model, ref = make(groups), make(ParallelGroups.single())
    opt = _zero(model, groups, stage, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    for step in range(steps):
        loop(model, opt, step, rank, 1.0)
        opt.step()
        opt.zero_grad()
        for r in range(world):
            loop(ref, None, step, r, 1.0 / world)
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_like(model, opt, ref, groups, f"{loop.__name__}, stage {stage}, ep {ep}")
    groups.destroy()
    return True


def _full(opt):
    import contextlib

    return opt.full_parameters() if opt is not None else contextlib.nullcontext()


# ---- 0: a penalty computed inside full_parameters(), backpropagated after it ---------------------------------
def _penalty_after_the_forward(model, opt, step, rank, scale):
    loss = _loss(model, step, rank)
    with _full(opt):  # the root (held for the backward) was exposed: its params' uses were saved unguarded
        # (dense params: each rank holds its own experts, whose penalty would count once per holder, not per rank)
        penalty = 1e-3 * sum(p.square().sum() for p in model.parameters() if not is_expert_parallel(p))
    (scale * (loss + penalty)).backward()


def _penalty_loops(stage):
    for ep in (1, 2):
        _train_like_torch(_penalty_after_the_forward, stage, ep)
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_a_penalty_computed_inside_full_parameters_after_the_forward_trains_like_torch(stage):
    """Both ranks segfaulted at stage 3: leaving full_parameters() freed the root the pending backward holds,
    and the penalty's ops had saved its params as plain tensors (the root was exposed)."""
    assert all(run_distributed(_penalty_loops, 2, stage, isolated=True, timeout=240))


# ---- 5: full_parameters() nests, and a step inside it ---------------------------------------------------------
def _dense_norm(opt, model):
    """A logging helper that opens full_parameters() itself."""
    with _full(opt):
        return sum(p.norm() for p in model.parameters() if not is_expert_parallel(p)).item()


def _nested_and_a_step_inside(stage):
    world, rank = dist.get_world_size(), dist.get_rank()
    for ep in (1, 2):
        groups = ParallelGroups.build(expert_parallel_size=ep)
        model, ref = _Net(groups), _Net(ParallelGroups.single())
        opt, ref_opt = _zero(model, groups, stage), torch.optim.AdamW(ref.parameters(), lr=0.02)
        for step in range(3):
            with opt.full_parameters():
                assert abs(_dense_norm(opt, model) - _dense_norm(None, ref)) < 1e-12
                before = model.head.weight.sum().item()  # a read after the nested block ended
                _loss(model, step, rank).backward()
                opt.step()
                opt.zero_grad()
                for r in range(world):
                    (_loss(ref, step, r) / world).backward()
                ref_opt.step()
                ref_opt.zero_grad()
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):  # the step's values, here
                    torch.testing.assert_close(
                        p.detach(),
                        local_reference_slice(name, p, q.detach()),
                        rtol=TOL,
                        atol=1e-13,
                        msg=lambda m: f"after the step inside, {name}: {m}",
                    )
                assert model.head.weight.sum().item() != before
                with torch.no_grad():  # a write after the step persists
                    model.head.bias.mul_(0.5)
                    ref.head.bias.mul_(0.5)
        _assert_like(model, opt, ref, groups, f"nested, a step inside, stage {stage}, ep {ep}")
        groups.destroy()
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_full_parameters_nests_and_a_step_inside_it_is_torchs(stage):
    """Leaving full_parameters() raised 'setStorage ... size 0' after a nested block or a step inside it, and a
    read between the two exits said it was outside."""
    assert all(run_distributed(_nested_and_a_step_inside, 2, stage))


# ---- 3: a block skipped on one rank (LayerDrop, early exit) ----------------------------------------------------
SKIPS = [(0, 3), (0, 1), (144, 0), (144, 1), (144, 2), (144, 3)]  # (min_unit_params, the block skipped)


def _layer_drop(blocks):
    def loop(model, opt, step, rank, scale):
        model.skip = blocks if (rank + step) % 2 else set()  # rank 1 drops them at even steps, rank 0 at odd ones
        (scale * _loss(model, step, rank)).backward()
        model.skip = set()

    loop.__name__ = f"dropping blocks {sorted(blocks)}"
    return loop


def _four_blocks(groups):
    return _Net(groups, moe=(False, True, False, False))  # block 1's experts: a unit nested in its block's


def _skipped_blocks(stage):
    for min_unit_params, block in SKIPS:  # 72 params a block: 144 makes runs blocks.0..1 and blocks.2..3
        _train_like_torch(_layer_drop({block}), stage, 1, make=_four_blocks, min_unit_params=min_unit_params)
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_a_block_one_rank_skips_trains_like_torch(stage):
    """Rank 1 skipping the last block hung both ranks at stage 3 (the rank that ran it kept it gathered for the
    backward, the other gathered it again); with runs of blocks as units, skipping a run's last block hung and
    skipping its first raised RanksDisagree (the run's hooks sat on those modules only)."""
    assert all(run_distributed(_skipped_blocks, 2, stage, isolated=True, timeout=400))


# ---- 1: writes through .data in forward -----------------------------------------------------------------------
def _writing_through_data(groups):
    model = _Net(groups)
    model.zero_padding_row = True  # the root: `emb.weight.data[0].zero_()`
    for block in model.blocks:
        block.clamp_data = True  # a block: `fc.weight.data.clamp_(-0.25, 0.25)`
    return model


def _plain_loop(model, opt, step, rank, scale):
    (scale * _loss(model, step, rank)).backward()


def _data_writes(stage):
    for ep in (1, 2):
        _train_like_torch(_plain_loop, stage, ep, make=_writing_through_data)
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_writes_through_data_in_forward_persist_like_torch(stage):
    """`.data` has a version counter of its own: stage 3 noticed only the param's, and these writes were lost
    silently (0.68 and 0.52 from torch)."""
    assert all(run_distributed(_data_writes, 2, stage))


# ---- 2: gradients assigned by hand (external gradients, gradient surgery), every stage ------------------------
def _assign_external_gradients(model, params, loss_of_rank, ranks):
    """`torch.autograd.grad` of each rank's loss, halved and assigned to `.grad` (which it leaves untouched)."""
    total = None
    for r in ranks:
        grads = torch.autograd.grad(loss_of_rank(r), params)
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    assert all(p.grad is None for p in params), "torch.autograd.grad wrote .grad"
    for p, g in zip(params, total):
        p.grad = 0.5 * g


def _assigned_gradients(stage):
    world, rank = dist.get_world_size(), dist.get_rank()
    for ep in (1, 2):
        groups = ParallelGroups.build(expert_parallel_size=ep)
        model, ref = _Net(groups), _Net(ParallelGroups.single())
        opt, ref_opt = _zero(model, groups, stage), torch.optim.AdamW(ref.parameters(), lr=0.02)
        for step in range(2):
            _assign_external_gradients(model, list(model.parameters()), lambda r: _loss(model, step, r), [rank])
            _assign_external_gradients(ref, list(ref.parameters()), lambda r: _loss(ref, step, r) / world, range(world))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            _loss(model, step + 5, rank).backward()  # surgery after a backward: one gradient replaced by hand
            model.head.bias.grad = torch.full(model.head.bias.shape, 0.1, dtype=torch.float64)
            for r in range(world):
                (_loss(ref, step + 5, r) / world).backward()
            ref.head.bias.grad = torch.full(ref.head.bias.shape, 0.1, dtype=torch.float64)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        _assert_like(model, opt, ref, groups, f"assigned gradients, stage {stage}, ep {ep}")
        groups.destroy()
    return True


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_assigned_gradient_is_what_the_step_uses_as_in_torch(stage):
    """`p.grad = g` then `opt.step()` moved no param at stages 0, 2 and 3 (the step read the buckets), and after
    torch.autograd.grad `.grad` was a tensor (a ShardedGradient at stages 1-3) where torch's is None."""
    assert all(run_distributed(_assigned_gradients, 2, stage))


# ---- 4: double backward (gradient penalties) ------------------------------------------------------------------
def _gradient_penalties(model, opt, step, rank, scale):
    """A penalty on the gradient with respect to the input (the embedded tokens) and on the params' gradients."""
    loss = _loss(model, step, rank)
    (grad_input,) = torch.autograd.grad(loss, model.embedded, create_graph=True)
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    penalty = grad_input.square().sum() + 0.1 * sum(g.square().sum() for g in grads)
    (scale * (loss + penalty)).backward()


def _dense_net(groups):
    return _Net(groups, moe=(False, False, False))


def _double_backward(stage, moe):
    try:
        _train_like_torch(_gradient_penalties, stage, 1, make=_Net if moe else _dense_net)
        return "trains like torch"
    except RuntimeError as exc:
        return str(exc)


@pytest.mark.parametrize("stage,moe", [(2, False), (3, False), (2, True)])
def test_double_backward_trains_like_torch_or_raises_one_line_naming_the_way(stage, moe):
    """Stage 3 crashed (setStorage ... size 0, or SIGSEGV): the graph a create_graph backward records reads params
    whose units it freed. The MoE kernels are differentiable once, without ZeRO too: torch's own error named no
    layer."""
    results = run_distributed(_double_backward, 2, stage, moe, isolated=True, timeout=240)
    for message in results:
        if moe:
            assert message.startswith("a backward with create_graph=True") and "MoE layer" in message, message
        elif stage == 3:
            assert message.startswith("a backward with create_graph=True") and "Use stage=2" in message, message
        else:
            assert message == "trains like torch", message


# ---- 7: a .data swap on one rank inside full_parameters(modifier_rank=0) ----------------------------------------
def _swap_on_one_rank(stage):
    rank = dist.get_rank()
    groups = ParallelGroups.build(timeout=datetime.timedelta(seconds=20))
    model = _dense_net(groups)
    opt = _zero(model, groups, stage)
    try:
        with opt.full_parameters(modifier_rank=0):
            if rank == 0:
                model.head.weight.data = torch.zeros(VOCAB, WIDTH, dtype=torch.float64)
        _loss(model, 0, rank).backward()
        opt.step()
        return "no error"
    except RuntimeError as exc:
        return str(exc)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_storage_swapped_on_one_rank_inside_full_parameters_raises_on_every_rank(stage):
    """It raised on rank 0 (at its next forward) and left rank 1 waiting for ever."""
    first, second = run_distributed(_swap_on_one_rank, 2, stage, isolated=True, timeout=120)
    assert "'head.weight'" in first and "modify_model" in first, first
    assert second.startswith("another rank replaced a param's storage") and "modify_model" in second, second
