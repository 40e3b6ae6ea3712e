"""Ranks that disagree get an error on every rank naming what each was doing: never a hang, a gloo
abort or a silent divergence.

Every scenario runs on both ranks of one isolated world (its pending collectives are never joined,
so the world is killed afterwards) and returns each rank's error message.
"""

import datetime

import pytest

import torch
import torch.distributed as dist
from torch import nn

from moezero.moe import MoEConfig, MoELayer
from moezero.parallel import ParallelGroups
from moezero.parallel.agreement import Agreement, agree
from moezero.zero import RanksDisagree, ZeroOptimizer
from tests.dist_utils import run_distributed


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)
        self.order = [0, 1, 2]
        self.fail_in_block = None

    def forward(self, x):
        x = self.embed(x)
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
            if self.fail_in_block == i:
                self.fail_in_block = None
                raise ValueError("a data error on this rank")
        return self.head(x)


def _extra_forward(model, opt, rank):
    if rank == 0:  # an evaluation (or a generation that stops later) on rank 0 alone
        with torch.no_grad():
            model(torch.ones(2, 4))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def _block_order(model, opt, rank):
    model.order = [0, 1, 2] if rank == 0 else [0, 2, 1]
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def _retried_forward(model, opt, rank):
    model.fail_in_block = 1 if rank == 0 else None
    try:
        out = model(torch.ones(2, 4))
    except ValueError:
        out = model(torch.ones(2, 4))  # the loop retries on this rank only
    out.sum().backward()
    opt.step()


def _backward_reaching_no_param(model, opt, rank):
    out = model(torch.ones(2, 4))
    loss = out.sum() if rank == 0 else out.detach().sum().requires_grad_()  # e.g. a rank whose batch was empty
    loss.backward()
    opt.step()


def _swap_on_one_rank(model, opt, rank):
    with opt.modify_model():
        if rank == 0:
            model.blocks[1] = nn.Linear(4, 4)  # same shape, on one rank only


def _different_shapes(model, opt, rank):
    with opt.modify_model():
        model.head = nn.Linear(4, 2 + rank)


def _unseeded_init(model, opt, rank):
    with opt.modify_model():
        torch.manual_seed(rank)  # each rank draws its own init: the replicas would silently diverge
        model.blocks[1] = nn.Linear(4, 4)


SCENARIOS = {
    "extra forward": (_extra_forward, (3,)),
    "block order": (_block_order, (3,)),
    "retried forward": (_retried_forward, (3,)),
    "backward reaching no param": (_backward_reaching_no_param, (0, 1, 2, 3)),
    "swap on one rank": (_swap_on_one_rank, (0, 3)),
    "different shapes": (_different_shapes, (0, 3)),
    "unseeded init": (_unseeded_init, (0, 2)),
}


def _disagreements():
    rank = dist.get_rank()
    out = {}
    for name, (scenario, stages) in SCENARIOS.items():
        for stage in stages:
            groups = ParallelGroups.build()
            model = _Tower()
            opt = ZeroOptimizer(model, torch.optim.SGD, groups, stage=stage, lr=0.1)
            try:
                scenario(model, opt, rank)
                out[name, stage] = "no error"
            except RanksDisagree as exc:
                out[name, stage] = str(exc)
    for name in ("extra forward", "block order", "retried forward"):  # the 3 blocks one gather unit, blocks.0..2
        opt = ZeroOptimizer(
            model := _Tower(), torch.optim.SGD, ParallelGroups.build(), stage=3, lr=0.1, min_unit_params=21
        )
        try:
            SCENARIOS[name][0](model, opt, rank)
            out[name, "one unit of blocks"] = "no error"
        except RanksDisagree as exc:
            out[name, "one unit of blocks"] = str(exc)
    out["several records"] = _several_records_in_one_message(rank, [[1, 0], [2, rank], [3, 0]])
    out["unused slot"] = _several_records_in_one_message(rank, [[1, 0], [2, 0], [3, 0]][: 2 + rank])
    out["timeout"] = _peer_never_arrives(rank)
    out["unit plans"] = _different_unit_plans(rank)
    return out


def _different_unit_plans(rank):
    """Ranks given different min_unit_params (a launch line per rank): told at construction, naming the knob."""
    try:
        ZeroOptimizer(
            _Tower(), torch.optim.SGD, ParallelGroups.build(), stage=3, lr=0.1, min_unit_params=0 if rank == 0 else 1000
        )
        return "no error"
    except RanksDisagree as exc:
        return str(exc)


def _several_records_in_one_message(rank, records):
    """Records launched together travel in one all-reduce: the report names the first that differs."""
    group = ParallelGroups.build().agreement_group()
    describe = lambda record: f"did {record[0]}.{record[1]}" if record[0] else "had no record left there"
    try:
        Agreement(records, group, describe).check()
        return "no error"
    except RanksDisagree as exc:
        return str(exc)


def _peer_never_arrives(rank):
    group = dist.new_group([0, 1], backend="gloo", timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        return "skipped"
    try:
        agree([5, 0, 0, 0, 0, 0], group, lambda record: "was ending a backward")
        return "no error"
    except RanksDisagree as exc:
        return str(exc)


def test_ranks_that_disagree_all_raise_naming_what_each_was_doing():
    results = run_distributed(_disagreements, 2, isolated=True, timeout=300)
    for rank, out in enumerate(results):
        # one unit for the 3 blocks: their order changes no gather, so ranks pair as at stage 2 (no error either)
        assert out.pop(("block order", "one unit of blocks")) == "no error"
        for (name, stage), message in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
            if name in ("swap on one rank", "different shapes", "unseeded init"):
                assert message.startswith("opt.modify_model(): the ranks made different changes"), message
                assert "rank 0" in message and "rank 1" in message, (name, stage, message)
            else:
                assert message.startswith("the ranks are not doing the same thing"), (rank, name, stage, message)
                assert f"this rank ({rank})" in message and "another rank" in message, (name, stage, message)
        assert "forward (without grad)" in out["extra forward", 3] and "(with grad)" in out["extra forward", 3]
        assert "unit 'blocks.0..2'" in out["extra forward", "one unit of blocks"]
        assert "after 2 forwards" in out["retried forward", "one unit of blocks"]
        assert "unit 'blocks.2'" in out["block order", 3] and "unit 'blocks.1'" in out["block order", 3]
        assert "after 2 forwards" in out["retried forward", 3] and "after 1 forwards" in out["retried forward", 3]
        for stage in (0, 1, 2):
            assert "ending a backward" in out["backward reaching no param", stage]
            assert "step()" in out["backward reaching no param", stage]
        for stage in (0, 3):
            assert (
                "'blocks.1.weight'" in out["swap on one rank", stage] and "replaced" in out["swap on one rank", stage]
            )
            assert "(2, 4)" in out["different shapes", stage] and "(3, 4)" in out["different shapes", stage]
        for stage in (0, 2):
            assert "'blocks.1.weight' holds different values" in out["unseeded init", stage]
    assert results[0]["several records"].endswith("this rank (0) did 2.0; another rank did 2.1")
    assert results[1]["several records"].endswith("this rank (1) did 2.1; another rank did 2.0")
    assert results[0]["unused slot"].endswith("this rank (0) had no record left there; another rank did 3.0")
    assert results[1]["unused slot"].endswith("this rank (1) did 3.0; another rank had no record left there")
    assert "rank 0 was ending a backward" in results[0]["timeout"] and "not every other rank" in results[0]["timeout"]
    for rank, out in enumerate(results):  # _Tower: the root and its 3 blocks vs the root alone
        assert "stage-3 plan has 4 gather units" in out["unit plans"], out["unit plans"]
        assert "stage-3 plan has 1 gather units" in out["unit plans"], out["unit plans"]
        assert "min_unit_params" in out["unit plans"]


class _MoEBlock(nn.Module):
    def __init__(self, groups, layer_number, load_balancing):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        config = MoEConfig(
            hidden_size=4,
            ffn_hidden_size=6,
            num_experts=2,
            top_k=1,
            aux_loss_coeff=0.01,
            load_balancing_type=load_balancing,
        )
        self.moe = MoELayer(config, groups, layer_number=layer_number)

    def forward(self, x):
        y, stats = self.moe(torch.tanh(self.fc(x)))
        return x + y + 0 * stats.aux_loss


class _MoETower(_Tower):
    """MoE blocks: their forwards exchange tokens (ep 2) or the global aux loss's counts (ep 1)."""

    def __init__(self, groups, load_balancing):
        super().__init__()
        self.blocks = nn.ModuleList(_MoEBlock(groups, i + 1, load_balancing) for i in range(3))


def _moe_disagreement(name, ep, load_balancing, stage, local_records=True):
    groups = ParallelGroups.build(
        expert_parallel_size=ep, timeout=datetime.timedelta(seconds=20), local_records=local_records
    )
    model = _MoETower(groups, load_balancing)
    opt = ZeroOptimizer(model, torch.optim.SGD, groups, stage=stage, lr=0.1)
    try:
        SCENARIOS[name][0](model, opt, dist.get_rank())
        return "no error"
    except RanksDisagree as exc:
        return str(exc)


def _moe_disagreements():
    out = {}
    for ep, load_balancing in ((1, "global_aux_loss"), (2, "aux_loss")):
        for name in ("retried forward", "block order"):
            for stage in (2, 3):
                out[name, ep, stage] = _moe_disagreement(name, ep, load_balancing, stage)
    for name in ("retried forward", "block order"):  # records on gloo, as when ranks are on several hosts
        out[name + " (gloo records)", 2, 3] = _moe_disagreement(name, 2, "aux_loss", 3, local_records=False)
    # ep 1, a local aux loss: the MoE layers make no collective, their experts are units of their own (it hung: the
    # retrying rank had launched its first forward's records ahead, the other waited in an expert unit's gather)
    out["retried forward (no exchanges)", 1, 3] = _moe_disagreement("retried forward", 1, "aux_loss", 3)
    return out


def test_moe_exchanges_carry_records_so_ranks_in_different_forwards_raise():
    """A forward retried on one rank, a rank-dependent block order: the MoE layers' exchanges (token all-to-all,
    global aux loss counts) would pair with another layer's or forward's. Their records ride on the exchanges:
    at stage 2 every rank raises RanksDisagree naming both layers. At stage 3 a rank could wait in an exchange
    while its peer waits in a unit gather (two groups): the exchange's record is also checked in the sequence of
    the gathers' records, and no gather waits before the records launched ahead agree, so every rank raises
    RanksDisagree there too, at once (the groups' timeout of 20 s is never reached), whether the records travel
    through pipes (ranks on one host) or on gloo. A forward that raised makes the gathers its schedule still owes
    before the rank's next collective (its retry), so a peer whose forward ran on is not left waiting in one."""
    results = run_distributed(_moe_disagreements, 2, isolated=True, timeout=400)
    for rank, out in enumerate(results):
        for (name, ep, stage), message in out.items():
            assert message.startswith("the ranks are not doing the same thing"), (rank, name, ep, stage, message)
            if stage == 2:
                assert "exchanges of 'blocks." in message, (rank, name, ep, message)
    for name, ep in (
        ("retried forward", 1),
        ("retried forward", 2),
        ("block order", 1),
        ("block order", 2),
        ("retried forward (gloo records)", 2),
        ("block order (gloo records)", 2),
    ):
        assert any("exchanges of 'blocks." in out[name, ep, 3] for out in results), (name, ep, results)


class _DetachedUse(nn.Module):
    """A block that, when `uses`, also reads its weight detached before its own forward (saved for backward)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.uses = False

    def forward(self, x):
        if self.uses:
            x = x @ self.fc.weight.detach().t()
        return self.fc(x)


def _detached_use_on_one_rank(block):
    rank = dist.get_rank()
    groups = ParallelGroups.build(timeout=datetime.timedelta(seconds=5))
    model = _Tower()
    model.blocks = nn.ModuleList(_DetachedUse() for _ in range(3))
    model.blocks[block].uses = rank == 0  # its backward gathers the freed unit again: rank 0 alone
    opt = ZeroOptimizer(model, torch.optim.SGD, groups, stage=3, lr=0.1)
    try:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        return "no error"
    except RanksDisagree as exc:
        return str(exc)


@pytest.mark.parametrize("block", [0, 1, 2])
def test_a_unit_gathered_again_in_one_ranks_backward_raises_on_every_rank(block):
    """Only rank 0's backward reads a freed unit again (a detached use of its weight that rank 1 does not make):
    its gather has a record of its own, which rank 1's backward does not state. Every rank raises RanksDisagree:
    at the latest when the group's timeout ends a wait that no record guards."""
    results = run_distributed(_detached_use_on_one_rank, 2, block, isolated=True, timeout=120)
    for rank, message in enumerate(results):
        assert (
            message.startswith("the ranks are not doing the same thing")
            and f"this rank ({rank})" in message
            or message.startswith(f"rank {rank} was gathering unit")
            and "not every other rank" in message
        ), (block, rank, message)
