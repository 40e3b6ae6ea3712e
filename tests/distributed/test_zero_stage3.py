"""Stage 3 (and modify_model at every stage): partitioned params, changed models, memory bound.

The field bugs: weights of a module swapped in after init left empty at forward, and a crash on
an nn.Parameter that a model rebuilds larger inside forward. Exactness of stage 3 itself is in
the central matrix (test_zero_exactness.py).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.parallel import ParallelGroups
from moezero.zero import ParameterSetChanged, ZeroOptimizer
from tests.dist_utils import assert_replicas_equal, run_distributed
from tests.zero_model import ZeroTestModel
from tests.zero_reference import OPTIMIZERS, ZERO_STAGES, assert_params_match, assert_passes, reference_run, train_step

TOL = 1e-10
STEPS = 5
SWAP_STEP = 2


def _new_twice():
    """The module swapped in: the same init on every rank and in the reference."""
    torch.manual_seed(1234)
    return nn.Linear(8, 8).double()


def _swap_in_reference(step, model, opt):
    """torch: swap the module, drop the old params from their group and put the new ones there (fresh state)."""
    if step != SWAP_STEP:
        return
    old = [model.twice.weight, model.twice.bias]
    model.twice = _new_twice()
    group = opt.param_groups[0]
    group["params"] = [p for p in group["params"] if all(p is not q for q in old)] + list(model.twice.parameters())
    for p in old:
        opt.state.pop(p, None)


def _swap_mid_run(stage, ep, optimizer):
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=ep)
    model = ZeroTestModel(groups).double()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = ZeroOptimizer(model, cls, groups, stage=stage, bucket_size=64, grad_reduce_dtype=torch.float64, **kwargs)
    reference = reference_run(optimizer, world, 2, STEPS, each_step=_swap_in_reference)
    for step in range(STEPS):
        if step == SWAP_STEP:
            with opt.modify_model():
                model.twice = _new_twice()
        train_step(model, opt, step, 2, use_no_sync=False)
        opt.step()
        opt.zero_grad()
    with opt.full_parameters():
        assert_params_match(model, reference[-1]["params"], rtol=TOL, atol=1e-13)
        assert_replicas_equal(model, groups)
    groups.destroy()
    return True


def test_a_module_swapped_through_modify_model_trains_like_torch():
    for stage in ZERO_STAGES:
        for optimizer in OPTIMIZERS:
            assert all(run_distributed(_swap_mid_run, 2, stage, 2, optimizer))
    assert all(run_distributed(_swap_mid_run, 4, 3, 2, "adamw"))


def _edits_inside_modify_model(stage):
    """In-place writes land, frozen params drop out, the rest keeps its optimizer state."""
    world = dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=2)
    model = ZeroTestModel(groups).double()
    cls, kwargs = OPTIMIZERS["adamw"]
    opt = ZeroOptimizer(model, cls, groups, stage=stage, bucket_size=64, grad_reduce_dtype=torch.float64, **kwargs)

    def edit(m):
        with torch.no_grad():
            m.norm.weight.mul_(0.5)
            m.moe2.experts.w1[:, 0].zero_()
        m.data_branch.requires_grad_(False)

    def edit_reference(step, m, ref_opt):
        if step == SWAP_STEP:
            edit(m)
            for p in m.data_branch.parameters():
                p.grad = None

    reference = reference_run("adamw", world, 1, STEPS, each_step=edit_reference)
    for step in range(STEPS):
        if step == SWAP_STEP:
            with opt.modify_model():
                edit(model)
        train_step(model, opt, step, 1, use_no_sync=False)
        opt.step()
        opt.zero_grad()
    with opt.full_parameters():
        assert_params_match(model, reference[-1]["params"], rtol=TOL, atol=1e-13)
    groups.destroy()
    return True


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_writes_and_freezing_inside_modify_model(stage):
    assert_passes(_edits_inside_modify_model, stage)


# ---- params made in forward; modules swapped by hand ---------------------------------------------------
class _Positions(nn.Module):
    """M2M100's sinusoidal positions: a table rebuilt larger, as an nn.Parameter, inside forward."""

    def __init__(self, trainable):
        super().__init__()
        self.trainable = trainable
        self.table = nn.Parameter(_sinusoids(2), requires_grad=False)

    def forward(self, length):
        if length > self.table.shape[0]:
            self.table = nn.Parameter(_sinusoids(length), requires_grad=self.trainable)
        return self.table[:length]


def _sinusoids(length):
    angles = torch.arange(length, dtype=torch.float64)[:, None] / 10.0 ** (torch.arange(4) / 2.0)
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class _Seq2SeqLike(nn.Module):
    def __init__(self, trainable_table=False):
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(16, 8)
        self.positions = _Positions(trainable_table)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.double()

    def forward(self, tokens):
        x = self.embed(tokens) + self.positions(tokens.shape[1])
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.linear(x, self.embed.weight)  # tied head in the root's forward


def _loss(model, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 16, (2, 3 + step), generator=g)  # sequences grow: the table is rebuilt
    return F.cross_entropy(model(tokens).reshape(-1, 16), tokens.reshape(-1))


def _trains_like_torch(model, ref, loss, stage, steps=4):
    """`steps` of AdamW under ZeRO at `stage` against torch on every rank's batch, then the weights compared."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = ParallelGroups.build()
    opt = ZeroOptimizer(
        model, torch.optim.AdamW, groups, stage=stage, bucket_size=40, lr=0.05, grad_reduce_dtype=torch.float64
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(steps):
        loss(model, step, rank).backward()
        opt.step()
        opt.zero_grad()
        sum(loss(ref, step, r) for r in range(world)).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with opt.full_parameters():
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=TOL, atol=1e-13, msg=lambda m: f"{name}: {m}")
    groups.destroy()


def _positions_rebuilt_in_forward(stage):
    model = _Seq2SeqLike()
    _trains_like_torch(model, _Seq2SeqLike(), _loss, stage)
    assert model.positions.table.shape[0] == 6
    return True


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_a_non_trainable_parameter_rebuilt_in_forward_just_works(stage):
    assert_passes(_positions_rebuilt_in_forward, stage)


def _named_errors(stage):
    groups = ParallelGroups.build()
    messages, optimizers = [], []  # the model holds its optimizer weakly: keep them alive
    model = _Seq2SeqLike(trainable_table=True)
    optimizers.append(ZeroOptimizer(model, torch.optim.SGD, groups, stage=stage, lr=0.1))
    try:
        _loss(model, 3, 0)
    except ParameterSetChanged as exc:
        messages.append(str(exc))
    model = _Seq2SeqLike()
    optimizers.append(ZeroOptimizer(model, torch.optim.SGD, groups, stage=stage, lr=0.1))
    old = model.blocks[1]
    model.blocks[1] = nn.Linear(8, 8).double()  # a compression pass swapping by hand
    model.blocks[1].weight.data = old.weight.data
    try:
        _loss(model, 0, 0)
    except ParameterSetChanged as exc:
        messages.append(str(exc))
    groups.destroy()
    return messages


def test_by_hand_swaps_and_trainable_params_made_in_forward_are_named_errors():
    for stage in ZERO_STAGES:
        for made_in_forward, swapped in run_distributed(_named_errors, 2, stage):
            assert "'positions.table' was created during forward" in made_in_forward
            assert "'blocks.1.weight' is trainable but the optimizer was not built with it" in swapped


# ---- QAT applied to a live optimizer ---------------------------------------------------------------------
def _gpt(groups):
    from moezero.config import GPTConfig, MoEConfig
    from moezero.models import GPTModel
    from moezero.moe import expert_parallel

    cfg = GPTConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        vocab_size=32,
        moe_layer_freq=1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(cfg, MoEConfig(num_experts=4, top_k=2), seed=3, moe_layer=expert_parallel(groups)).double()


def _gpt_losses(stage, ep, qat_step, steps=4, min_unit_params=0, units=None):
    """Per-step mean lm loss over the global batch (2 sequences per rank of a 2-rank world); `units` gets the
    names of the stage-3 units."""
    from moezero.compression import QATConfig, apply_qat
    from moezero.models import language_model_loss

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = ParallelGroups.build(expert_parallel_size=ep)
    model = _gpt(groups)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        groups,
        stage=stage,
        bucket_size=200,
        lr=0.01,
        grad_reduce_dtype=torch.float64,
        min_unit_params=min_unit_params,
    )
    if units is not None:
        units.extend(opt.engine.gatherer.plan.names)
    losses = []
    for step in range(steps):
        if step == qat_step:
            with opt.modify_model():
                apply_qat(model, QATConfig(weight_bits=4, groups=8, modules="attention,experts"), groups)
        total = 0.0
        for index in range(rank, 2, world) if world == 2 else range(2):
            g = torch.Generator().manual_seed(10 * step + index)
            tokens = torch.randint(0, 32, (2, 9), generator=g)
            logits, stats = model(tokens[:, :-1])
            loss = language_model_loss(logits, tokens[:, 1:], torch.ones(2, 8)) + sum(s.aux_loss for s in stats)
            (loss / (2 // world)).backward()
            total += loss.item() / 2
        opt.step()
        opt.zero_grad()
        summed = torch.tensor([total], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(summed)
        losses.append(summed.item())
    groups.destroy()
    return losses


def _small_blocks_together(_):
    from moezero.parallel import is_expert_parallel

    groups = ParallelGroups.build()
    dense = sum(p.numel() for p in _gpt(groups).layers[0].parameters() if not is_expert_parallel(p))
    groups.destroy()
    merged, run = [], []
    losses = {
        "root": _gpt_losses(3, 2, qat_step=99, min_unit_params=10**6, units=merged),
        "run": _gpt_losses(3, 2, qat_step=99, min_unit_params=dense + 1, units=run),
    }
    return losses, merged, run, _gpt_losses(3, 2, qat_step=99), _gpt_losses(2, 2, qat_step=99)


def test_small_blocks_are_gathered_together_and_train_alike():
    """min_unit_params: blocks that together fall short of it join the root's unit, blocks that reach it
    together share one (the expert stacks stay units either way); the losses equal every block a unit and
    stage 2 (float64, ep 2)."""
    losses, merged, run, per_block, stage2 = run_distributed(_small_blocks_together, 2, None)[0]
    assert merged == ["", "layers.0.mlp.experts", "layers.1.mlp.experts"], merged
    assert run == ["", "layers.0..1", "layers.0.mlp.experts", "layers.1.mlp.experts"], run
    for together in losses.values():
        torch.testing.assert_close(torch.tensor(together), torch.tensor(per_block), rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.tensor(per_block), torch.tensor(stage2), rtol=1e-12, atol=0)


def test_qat_applied_to_a_live_stage3_optimizer_tracks_one_process():
    single = _gpt_losses(2, 1, qat_step=2)
    plain = _gpt_losses(2, 1, qat_step=99)
    assert max(abs(a - b) for a, b in zip(single[2:], plain[2:])) > 1e-4, "QAT must change the curve"
    for ep in (1, 2):
        for losses in run_distributed(_gpt_losses, 2, 3, ep, 2):
            assert max(abs(a - b) / b for a, b in zip(losses, single)) < 1e-9, (losses, single)


def _tanh_stack():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def _dropped_forwards():
    """The unit a backward starts with stays gathered from its forward: forwards whose output is dropped (one
    between a backward and its step), a step with no gradients and eval forwards must not leave it stale."""
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, model = _tanh_stack(), _tanh_stack()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    opt = ZeroOptimizer(model, torch.optim.AdamW, ParallelGroups.build(), stage=3, lr=0.05)
    for step in range(4):
        model(x)  # with grad, output dropped
        if step == 1:
            opt.step()
            ref_opt.step()
        for m, o in ((model, opt), (ref, ref_opt)):
            (m(x) ** 2).sum().backward()
            m(x)  # dropped again, now before the step that changes the params
            o.step()
            o.zero_grad()
        with torch.no_grad():
            model(x)
    with opt.full_parameters():
        return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))


def test_dropped_forwards_and_idle_steps_leave_no_stale_unit():
    assert max(run_distributed(_dropped_forwards, 2)) < 1e-15


# ---- memory: what a rank keeps, and the working set ----------------------------------------------------
def _stack(width=128, depth=8):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _bytes_and_working_set(stage):
    groups = ParallelGroups.build()
    model = _stack()
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, lr=1e-3, bucket_size=10**9)
    seen = []
    for block in model:  # what the params hold while each block runs forward
        block.register_forward_hook(lambda m, i, o: seen.append(opt.memory_bytes()["params"]))
    model(torch.randn(4, 128)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    kept = opt.memory_bytes()
    groups.destroy()
    return kept, max(seen)


def test_stage3_keeps_one_nth_plus_the_working_set():
    unit_bytes = (128 * 128 + 128) * 4
    for world in (2, 4):
        stage0, _ = run_distributed(_bytes_and_working_set, world, 0)[0]
        stage3, working = run_distributed(_bytes_and_working_set, world, 3)[0]
        # persistent: params, grads and AdamW state all 1/N of stage 0's (buckets padded by at most
        # 16 * N elements per unit), plus at most 2 gradient buckets kept for reuse (one unit each here);
        # while a block runs: the param shard plus at most two units full (running + prefetched)
        padding = 8 * 16 * world * 4 * 4
        pool = 2 * unit_bytes
        for kind in ("params", "optimizer_state"):
            assert stage3[kind] <= stage0[kind] / world + padding, (world, kind, stage0, stage3)
        assert stage3["grads"] <= stage0["grads"] / world + pool + padding, (world, stage0, stage3)
        assert working <= stage3["params"] + 2 * unit_bytes + padding, (world, working, stage3)
        assert working >= stage3["params"] + unit_bytes  # the running unit is full


def _full_parameters_memory():
    model = _stack(16, 3)
    groups = ParallelGroups.build()
    opt = ZeroOptimizer(model, torch.optim.SGD, groups, stage=3, lr=0.1)
    shard = opt.memory_bytes()["params"]
    with opt.full_parameters():
        inside = opt.memory_bytes()["params"]
        assert model[2].weight.shape == (16, 16) and torch.isfinite(model[2].weight).all()
    after = opt.memory_bytes()["params"]
    groups.destroy()
    return shard, inside, after


def test_full_parameters_gathers_for_the_block_and_frees_after():
    for shard, inside, after in run_distributed(_full_parameters_memory, 2):
        assert inside >= shard + 3 * (16 * 16 + 16) * 4 and after == shard
    model = _stack(16, 3)  # a world of one holds whole buckets: nothing to gather, nothing held twice
    opt = ZeroOptimizer(model, torch.optim.SGD, stage=3, lr=0.1)
    shard = opt.memory_bytes()["params"]
    with opt.full_parameters():
        assert opt.memory_bytes()["params"] == shard and torch.isfinite(model[2].weight).all()


# ---- a block one rank skips, and a branch inside a block ---------------------------------------------------
class _BranchyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)  # inside the block's unit: used only when the data says so

    def forward(self, x, use_branch):
        y = torch.tanh(self.fc(x))
        return x + (self.branch(y) if use_branch else y)


class _SkippingTower(nn.Module):
    """Stage-3 units in a ModuleList; block 1 runs only for the micro-batches of rank 0 (the others skip the
    whole unit), and each block's branch runs when the micro-batch's first tokens say so."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_BranchyBlock() for _ in range(3))
        self.head = nn.Linear(8, 16)
        self.double()

    def forward(self, tokens, skip_block_1):
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i == 1 and skip_block_1:
                continue
            x = block(x, use_branch=int(tokens[0, i]) % 2 == 0)
        return self.head(x)


def _tower_loss(model, step, rank):
    tokens = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(31 * step + rank))
    return F.cross_entropy(model(tokens, rank != 0).reshape(-1, 16), tokens.reshape(-1))


def _skipped_unit_stays_paired(stage):
    _trains_like_torch(_SkippingTower(), _SkippingTower(), _tower_loss, stage)
    return True


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_a_unit_one_rank_skips_stays_paired_and_trains_like_torch(stage):
    assert_passes(_skipped_unit_stays_paired, stage)
    assert all(run_distributed(_skipped_unit_stays_paired, 4, 3))
