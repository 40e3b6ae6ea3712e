"""Optimizer checkpoint pieces of tensor-parallel shards as strided ranges (moezero/zero/strided_ranges.py): a few
keys per shard, whatever its rows, and any tp's pieces load into any other tp's shards. The oracle: global tensors
cut as each rank holds them (TensorShard.local_of), compared element by element."""

import itertools
import math

import pytest
import torch
from torch import nn

from moezero.checkpoint import keys
from moezero.parallel.expert_marker import ExpertShard, mark_expert_parallel
from moezero.parallel.tensor_marker import TensorShard, mark_tensor_parallel
from moezero.zero.state import assemble, check_covered_once, consolidate, span_pieces
from moezero.zero.strided_ranges import Span, intersects, overlap, shard_spans
from moezero.zero.zero_param import param_global_spans

# name: (global shape, split dim, fused parts along it, experts stacked along dim 0)
PARAMS = {
    "row.weight": ((8, 16), 1, None, False),  # row-parallel (out, in): split on `in`
    "fused.weight": ((24, 4), 0, (8, 8, 8), False),  # column-parallel [q | k | v]
    "experts.w1": ((4, 3, 16), 2, (8, 8), True),  # ETP GLU fc1 [gate | up] on the ffn dim
    "experts.w2": ((4, 8, 3), 1, None, True),  # ETP fc2 on the ffn dim
}


def _global_values():
    gen = torch.Generator().manual_seed(0)
    return {
        name: {f: torch.randn(shape, generator=gen, dtype=torch.float64) for f in ("master", "exp_avg")}
        for name, (shape, *_) in PARAMS.items()
    }


def _holdings(name, tp, ep, dp, values):
    """(param tagged as its rank holds it, that rank's part [lo, hi) of its flat elements, its master and exp_avg
    there) for every rank of a tp x ep x dp layout (dp splits each shard's flat elements, unevenly)."""
    shape, dim, parts, experts = PARAMS[name]
    ep = ep if experts else 1
    local_experts = shape[0] // ep
    for ep_rank, tp_rank in itertools.product(range(ep), range(tp)):
        rows = slice(ep_rank * local_experts, (ep_rank + 1) * local_experts) if experts else slice(None)
        place = (local_experts,) + shape[1:] if experts else shape
        shard = TensorShard.split(place, dim, tp_rank, tp, parts)
        local = {f: shard.local_of(v[rows]).reshape(-1) for f, v in values.items()}
        p = nn.Parameter(local["master"].view(shard.local_shape).clone())
        if tp > 1:
            mark_tensor_parallel(p, shard)
        if ep > 1:
            mark_expert_parallel(p, ExpertShard(local_experts, ep_rank, ep))
        cuts = [0] + [p.numel() * (d + 1) // dp + (d % 2) for d in range(dp - 1)] + [p.numel()]
        for lo, hi in zip(cuts, cuts[1:]):
            yield p, lo, hi, {f: v[lo:hi] for f, v in local.items()}


def _pairs(p, lo, hi):
    return [(local.shifted(-lo), glob) for local, glob in param_global_spans(p, lo, hi)]


def _save(tp, ep, dp, values):
    """{key: tensor} of every rank's pieces of every param (what DCP stores), as save_checkpoint writes them."""
    entries = {}
    for name in PARAMS:
        for p, lo, hi, local in _holdings(name, tp, ep, dp, values[name]):
            state = {"exp_avg": local["exp_avg"], "step": torch.tensor(7.0)}
            saved = keys.piece_entries({name: span_pieces(_pairs(p, lo, hi), local["master"], state)})
            assert not set(saved) & set(entries), "two ranks wrote one key"
            entries.update(saved)
    return entries


def test_spans_map_every_local_element_to_its_global_one():
    """Local flat ranges of row-parallel, fused and ETP-like shards, at tp 1/2/4: the (local, global) span
    pairs tile the range once, match the global tensor's elements run for run, and number at most 3 per block."""
    for (shape, dim, parts, _), tp in itertools.product(PARAMS.values(), (1, 2, 4)):
        for rank in range(tp):
            shard = TensorShard.split(shape, dim, rank, tp, parts)
            at = shard.local_of(torch.arange(math.prod(shape)).view(shape)).reshape(-1)
            ranges = itertools.combinations(range(at.numel() + 1), 2)  # a sample: every head, body, tail kind
            for lo, hi in (r for i, r in enumerate(ranges) if i % 13 == 0 or r[1] == at.numel()):
                pairs = shard_spans(shard.global_shape, dim, shard.blocks, lo, hi)
                seen = torch.cat([local.indices() for local, _ in pairs])
                assert sorted(seen.tolist()) == list(range(lo, hi))
                for local, glob in pairs:
                    assert torch.equal(at[local.indices()], glob.indices()), (shape, tp, rank, lo, hi)
                assert len(pairs) <= 3 * len(shard.blocks)


@pytest.mark.parametrize(
    "saved, loaded",
    [
        ((2, 2, 2), (1, 1, 1)),
        ((2, 2, 2), (4, 1, 3)),
        ((1, 1, 2), (2, 2, 2)),
        ((4, 1, 3), (2, 2, 1)),
        ((1, 2, 1), (4, 1, 2)),
    ],
    ids=["tp2-to-tp1", "tp2-to-tp4", "tp1-to-tp2", "tp4-to-tp2", "tp1-to-tp4"],
)
def test_pieces_round_trip_across_tp_through_keys(saved, loaded):
    """Saved at one (tp, ep, dp), each rank of another selects the keys that hold its elements and assembles its
    master and state: exactly its cut of the global tensors. tp 1 keeps the plain keys."""
    values = _global_values()
    entries = _save(*saved, values)
    if saved[0] == 1:
        assert all(keys.piece_of(key)[1].__len__() == 2 for key in entries), "tp 1 writes plain ranges only"
    else:
        assert any("x" in key.split("/")[-2] for key in entries), "strided keys expected at tp > 1"
    for name in PARAMS:
        for p, lo, hi, local in _holdings(name, *loaded, values[name]):
            pairs = _pairs(p, lo, hi)
            wanted = keys.piece_keys(entries, {name: [glob.as_range() for _, glob in pairs]})
            pieces = keys.pieces_from_entries({key: entries[key] for key in wanted})
            master, state = assemble(pieces, name, pairs, hi - lo)
            assert torch.equal(master, local["master"]) and torch.equal(state["exp_avg"], local["exp_avg"])
            assert float(state["step"]) == 7.0


def test_strided_pieces_consolidate_and_are_checked_once():
    """consolidate joins strided pieces into the global tensors; a missing or a doubled piece is refused."""
    values = _global_values()
    pieces = keys.pieces_from_entries(_save(2, 2, 2, values))
    shapes = {name: shape for name, (shape, *_) in PARAMS.items()}
    full = consolidate([{"pieces": pieces, "shapes": shapes}])
    for name in PARAMS:
        assert torch.equal(full["params"][name], values[name]["master"])
        assert torch.equal(full["state"][name]["exp_avg"], values[name]["exp_avg"])
    name = "row.weight"
    strided = next(i for i, piece in enumerate(pieces[name]) if len(piece["range"]) == 4)
    numel = math.prod(shapes[name])
    with pytest.raises(ValueError, match="cover parameter 'row.weight' 0..1 times"):
        check_covered_once(pieces[name][:strided] + pieces[name][strided + 1 :], name, numel)
    with pytest.raises(ValueError, match="cover parameter 'row.weight' 1..2 times"):
        check_covered_once(pieces[name] + [pieces[name][strided]], name, numel)


def test_key_count_of_a_large_row_parallel_weight_is_constant():
    """A (4096, 4096) row-parallel weight at tp 2 x dp 2: each rank's part is 2048 rows of 2048 columns, one
    global range per row; as strided pieces it is at most three (head row, whole rows, tail row)."""
    shape, tp, dp = (4096, 4096), 2, 2
    for tp_rank in range(tp):
        shard = TensorShard.split(shape, 1, tp_rank, tp)
        p = torch.empty(shard.local_shape, device="meta")
        mark_tensor_parallel(p, shard)
        for dp_rank in range(dp):
            lo, hi = p.numel() * dp_rank // dp, p.numel() * (dp_rank + 1) // dp
            spans = [glob for _, glob in param_global_spans(p, lo, hi)]
            assert len(shard.global_flat_ranges(lo, hi)) == 2048  # the per-row form
            assert len(spans) == 1 and spans[0].count == 2048 and spans[0].numel == hi - lo
            uneven = [glob for _, glob in param_global_spans(p, lo + 5, hi - 7)]
            assert len(uneven) == 3 and sum(s.numel for s in uneven) == hi - lo - 12


def test_overlap_of_plain_and_strided_spans_is_their_common_elements():
    """`overlap` and `intersects` against the sets of elements, for strided and plain spans of every kind."""
    gen = torch.Generator().manual_seed(1)

    def draw():
        lo, width = int(torch.randint(0, 30, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        if torch.rand(1, generator=gen) < 0.3:
            return Span(lo, lo + width)
        count, gap = (int(torch.randint(2, 6, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen)))
        return Span(lo, lo + width, count, width + gap)

    for _ in range(2000):
        a, b = draw(), draw()
        ia, ib = a.indices(), b.indices()
        common = set(ia.tolist()) & set(ib.tolist())
        assert intersects(a, b) == bool(common), (a, b)
        found = overlap(a, b)
        if found is None:
            assert not common, (a, b)
            continue
        in_b, in_a = found
        assert torch.equal(ib[in_b], ia[in_a]) and sorted(ib[in_b].tolist()) == sorted(common), (a, b)


def test_strided_keys_parse_back():
    """The key of a strided piece names its runs; a plain one keeps today's form."""
    assert Span(3, 5, 4, 10).key() == "3-5x4s10" and Span(3, 5).key() == "3-5"
    assert keys.piece_of("optimizer/a.b/3-5x4s10/exp_avg") == ("a.b", (3, 5, 4, 10))
    assert keys.piece_of("optimizer/a.b/3-5/master") == ("a.b", (3, 5))


def _adamw_shards(tp, stage):
    """One AdamW step on a row-parallel (6, 8) weight and a fused column (12, 4) one, as each tp rank's ZeroOptimizer
    (an in-process world of one holding its tagged shards) and as one process on the global tensors."""
    from moezero.parallel import ParallelGroups
    from moezero.zero import ZeroOptimizer

    gen = torch.Generator().manual_seed(2)
    specs = {"row": ((6, 8), 1, None), "fused": ((12, 4), 0, (4, 8))}
    whole = {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, (shape, _, _) in specs.items()}
    grads = {name: torch.randn(w.shape, generator=gen, dtype=torch.float64) for name, w in whole.items()}
    reference = {name: nn.Parameter(w.clone()) for name, w in whole.items()}
    ref_opt = torch.optim.AdamW(reference.values(), lr=0.1)
    for name, p in reference.items():
        p.grad = grads[name].clone()
    ref_opt.step()
    ranks = []
    for rank in range(tp):
        model, cuts = nn.Module(), {}
        for name, (shape, dim, parts) in specs.items():
            cuts[name] = TensorShard.split(shape, dim, rank, tp, parts)
            setattr(model, name, nn.Parameter(cuts[name].local_of(whole[name])))
            if tp > 1:
                mark_tensor_parallel(getattr(model, name), cuts[name])
        opt = ZeroOptimizer(model, torch.optim.AdamW, ParallelGroups.single(), stage=stage, lr=0.1)
        for name, p in model.named_parameters():
            p.grad = cuts[name].local_of(grads[name])
        opt.step()
        ranks.append((model, opt, cuts))
    return reference, ref_opt, ranks


def test_optimizer_state_saved_at_tp2_loads_at_tp1_and_tp4():
    """ZeroOptimizer.state_dict's pieces of both tp-2 ranks consolidate to one process's AdamW weights and state,
    and through their keys load into every rank of tp 4 and tp 1 (load_state_dict): each then holds exactly its cut
    of what was saved."""
    reference, ref_opt, saved = _adamw_shards(2, stage=1)
    shards = [opt.state_dict() for _, opt, _ in saved]
    entries = {}
    for shard in shards:
        assert len(keys.piece_entries(shard["pieces"])) <= 2 * 3 * 4  # two params, a few pieces, four fields
        entries.update(keys.piece_entries(shard["pieces"]))
    full = consolidate(shards)
    for name, q in reference.items():  # AdamW's kernels round alike only up to the size of the tensors they step
        torch.testing.assert_close(full["params"][name], q.detach(), rtol=0, atol=1e-15)
        torch.testing.assert_close(full["state"][name]["exp_avg"], ref_opt.state[q]["exp_avg"], rtol=0, atol=1e-15)
    scalars = {k: v for k, v in shards[0].items() if k not in ("pieces", "replicas")}
    for tp in (1, 4):
        for model, opt, cuts in _adamw_shards(tp, stage=2)[2]:
            wanted = keys.piece_keys(entries, opt.held_ranges())
            opt.load_state_dict({"pieces": keys.pieces_from_entries({k: entries[k] for k in wanted}), **scalars})
            for name, p in model.named_parameters():
                assert torch.equal(p.detach(), cuts[name].local_of(full["params"][name])), (tp, name)
                leaf = next(piece.master for piece in opt.engine.master_pieces() if piece.param.param is p)
                exp_avg = opt.inner.state[leaf]["exp_avg"].view(p.shape)
                assert torch.equal(exp_avg, cuts[name].local_of(full["state"][name]["exp_avg"])), (tp, name)
