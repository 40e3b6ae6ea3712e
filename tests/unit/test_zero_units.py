"""Stage 3's gather units on their own (`moezero/zero/units.py`'s `plan_units`): which params a unit holds, in
which order units are gathered, and how `min_unit_params` runs consecutive blocks together."""

import torch
from torch import nn

from moezero.parallel import ExpertShard, mark_expert_parallel
from moezero.zero.unit_plan import plan_units


class _Experts(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, n))
        mark_expert_parallel(self.w, ExpertShard(num_local_experts=2, ep_rank=0, ep_size=1))


class _Block(nn.Module):
    """`dense` dense params; an expert stack of 2 x `experts` params when `experts`."""

    def __init__(self, dense: int, experts: int = 0):
        super().__init__()
        self.proj = nn.Linear(dense, 1, bias=False)
        self.experts = _Experts(experts) if experts else None


def _model(sizes, experts=0):
    model = nn.Module()
    model.embed = nn.Embedding(4, 5)  # 20 params, the root's
    model.layers = nn.ModuleList(_Block(n, experts) for n in sizes)
    return model


def _plan(model, min_unit_params):
    plan = plan_units(model, list(model.parameters()), min_unit_params)
    forward = [plan.names[u] for u in plan.forward_order]
    backward = [plan.names[u] for u in plan.backward_order]
    return plan, forward, backward


def test_every_block_a_unit_by_default():
    model = _model([10, 10, 10])
    plan, forward, backward = _plan(model, 0)
    assert forward == ["layers.0", "layers.1", "layers.2"] and backward == forward[::-1]
    assert plan.unit_of[id(model.embed.weight)] == 0
    assert all(plan.modules[u] is plan.last_modules[u] for u in plan.forward_order)


def test_consecutive_blocks_run_together_until_they_reach_the_minimum():
    # 10 + 10 = 20 >= 15: blocks 0-1; 30: block 2; 5 + 5 = 10 short: joins block 2's run
    model = _model([10, 10, 30, 5, 5])
    plan, forward, backward = _plan(model, 15)
    assert forward == ["layers.0..1", "layers.2..4"] and backward == forward[::-1]
    first, second = plan.forward_order
    assert plan.modules[first] is model.layers[0] and plan.last_modules[first] is model.layers[1]
    assert plan.modules[second] is model.layers[2] and plan.last_modules[second] is model.layers[4]
    assert {plan.unit_of[id(b.proj.weight)] for b in model.layers[:2]} == {first}
    assert {plan.unit_of[id(b.proj.weight)] for b in model.layers[2:]} == {second}


def test_blocks_all_short_of_the_minimum_stay_with_the_root():
    model = _model([10, 10, 10])
    plan, forward, _ = _plan(model, 31)
    assert forward == [] and {plan.unit_of[id(p)] for p in model.parameters()} == {0}


def test_expert_stacks_stay_units_of_their_own_and_do_not_count():
    # dense 10 per block; the experts' 2 x 100 do not count toward the minimum
    model = _model([10, 10, 10, 10], experts=100)
    plan, forward, backward = _plan(model, 20)
    assert forward == [
        "layers.0..1",
        "layers.0.experts",
        "layers.1.experts",
        "layers.2..3",
        "layers.2.experts",
        "layers.3.experts",
    ]
    # reverse post-order: a run's backward starts at its last block's output, before its expert stacks'
    assert backward == [
        "layers.2..3",
        "layers.3.experts",
        "layers.2.experts",
        "layers.0..1",
        "layers.1.experts",
        "layers.0.experts",
    ]
    experts = {plan.unit_of[id(b.experts.w)] for b in model.layers}
    assert len(experts) == 4 and not experts & {plan.unit_of[id(b.proj.weight)] for b in model.layers}


def _messages(schedule):
    """Schedule positions (the lead: -1) grouped by the agreement message their records travel in."""
    by_message = {}
    for position, message in schedule.records.items():
        by_message.setdefault(id(message), []).append(position)
    return sorted(sorted(positions) for positions in by_message.values())


def test_forward_records_travel_one_per_message_and_backward_records_together():
    """A forward's records are launched a message per position, two positions ahead (an MoE layer's or an
    on-demand gather's record may fall between them, and a rank about to wait in a gather must have launched
    one its peer has not); a backward's, where nothing falls between them, all in its first message."""
    from moezero.parallel.agreement import RECORDS_PER_MESSAGE
    from moezero.zero.rank_agreement import Activity, RankAgreement
    from moezero.zero.gather_schedule import GatherSchedule

    order = [1, 2, 3, 4, 5]  # units; their positions 0-4, the pass's end 5
    forward = GatherSchedule(
        order, Activity.FORWARD_GATHER, Activity.FORWARD_GATHERS_END, RankAgreement(None), set(order) | {0}, lead=0
    )
    forward.reset()
    assert _messages(forward) == [[-1, 0], [1]]  # the root's record rides with the first position's
    forward.settle_lead()
    forward.settle_record(1)
    assert _messages(forward) == [[1], [2]]
    forward.settle_record(4)  # position 3 (positions 1 and 2 left unsettled, as a pass that skipped them)
    assert _messages(forward) == [[1], [2], [4], [5]]
    backward = GatherSchedule(
        order[::-1],
        Activity.BACKWARD_GATHER,
        Activity.BACKWARD_GATHERS_END,
        RankAgreement(None),
        set(order),
        per_message=RECORDS_PER_MESSAGE,
    )
    backward.reset()
    assert _messages(backward) == [[0, 1, 2, 3, 4, 5]]
    assert backward.agreement.launched == 1
    long_pass = GatherSchedule(
        list(range(1, 12)),
        Activity.BACKWARD_GATHER,
        Activity.BACKWARD_GATHERS_END,
        RankAgreement(None),
        set(range(1, 12)),
        per_message=RECORDS_PER_MESSAGE,
    )
    long_pass.reset()
    long_pass.settle_record(7)  # position 6: the second message (positions 8-10 and the end) is launched
    assert _messages(long_pass) == [[0, 1, 2, 3, 4, 5, 7], [8, 9, 10, 11]]
    assert long_pass.agreement.launched == 2
