import datetime
import gc
import weakref

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups, rank_layout
from moezero.parallel import comm, transport
from moezero.parallel.local_transport import LocalTransport
from moezero.parallel.transport import GlooTransport, transport_of
from tests.dist_utils import run_distributed


def _members(group):
    size = comm.group_size(group)
    out = torch.zeros(size, dtype=torch.int64)
    comm.all_gather(out, torch.tensor([dist.get_rank()]), group)
    return tuple(out.tolist())


def _check_groups():
    seen = {}
    for ep in (1, 2, 4):
        groups = ParallelGroups.build(expert_parallel_size=ep)
        layout = rank_layout(4, ep)
        rank = dist.get_rank()
        assert _members(groups.dp) == (0, 1, 2, 3)
        assert _members(groups.control) == (0, 1, 2, 3)
        assert _members(groups.ep) == layout.ep_group_of(rank)
        assert _members(groups.edp) == layout.edp_group_of(rank)
        assert groups.ep_rank == layout.ep_group_of(rank).index(rank)
        assert groups.edp_rank == layout.edp_group_of(rank).index(rank)
        assert len({id(groups.dp), id(groups.edp), id(groups.control)}) == 3
        seen[ep] = (_members(groups.ep), _members(groups.edp))
        groups.destroy()
    return seen


def test_groups_on_four_ranks():
    results = run_distributed(_check_groups, 4)
    assert results[1][2] == ((0, 1), (1, 3))
    assert results[2][4] == ((0, 1, 2, 3), (2,))


# send_counts[i][j]: rows rank i sends to rank j (zeros included, a rank sending nothing at all too)
SEND_COUNTS = [[0, 3, 1, 2], [2, 0, 0, 1], [0, 0, 0, 0], [1, 4, 2, 0]]


def _rows_from(i, hidden):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(sum(SEND_COUNTS[i]), hidden, generator=g, dtype=torch.float64)


def _check_all_to_all(hidden):
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=world)
    x = _rows_from(rank, hidden).requires_grad_(True)
    counts = torch.tensor([SEND_COUNTS[rank]] * world)  # row j goes to rank j: the whole send vector
    recv_counts = comm.exchange_counts(counts, groups.ep)  # row i: what rank i sends everyone
    output_splits = recv_counts[:, rank].tolist()
    assert output_splits == [SEND_COUNTS[i][rank] for i in range(world)]
    y = comm.all_to_all(x, output_splits, SEND_COUNTS[rank], groups.ep)
    # reference: every rank rebuilds every other rank's rows and picks what was sent to it
    expected = []
    for i in range(world):
        rows = _rows_from(i, hidden)
        start = sum(SEND_COUNTS[i][:rank])
        expected.append(rows[start : start + SEND_COUNTS[i][rank]])
    torch.testing.assert_close(y, torch.cat(expected), rtol=0, atol=0)
    # gradient: d/dx of sum(y * w(rank)) is w(destination) on the rows sent there
    (y * (rank + 1.0)).sum().backward()
    dest = torch.repeat_interleave(torch.arange(world), torch.tensor(SEND_COUNTS[rank]))
    expected_grad = (dest + 1.0).to(torch.float64)[:, None].expand(-1, hidden)
    torch.testing.assert_close(x.grad, expected_grad, rtol=0, atol=0)
    _check_exchange_released(x, output_splits, groups.ep)
    groups.destroy()
    return y.shape[0]


def _check_exchange_released(x, output_splits, group):
    """After its backward nothing keeps a launched exchange alive: a waited work holds its rows, whose autograd
    node holds the exchange, a cycle through C++ that gc cannot collect (it kept every step's rows: 16 MB a step
    on the benchmarks' GPT-MoE, growing without end)."""
    pending = comm.launch_all_to_all(x, output_splits, SEND_COUNTS[dist.get_rank()], group)
    released = weakref.ref(pending)
    y = pending.wait()
    del pending
    y.sum().backward()
    del y
    gc.collect()
    assert released() is None, "a launched all-to-all outlived its backward"


def _check_reduce_scatter():
    """Over groups of 4 (dp) and 2 (ep 2), sync and async, fp32 and bf16: this rank's slice of the sum, the
    pieces added in rank order (so bitwise a sequential sum of the members' inputs)."""
    rank = dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    members = {groups.dp: [0, 1, 2, 3], groups.ep: [rank - rank % 2, rank - rank % 2 + 1]}
    for group, ranks in members.items():
        size, me = len(ranks), ranks.index(rank)
        for dtype in (torch.float32, torch.bfloat16):
            for async_op in (False, True):

                def inputs(r):
                    return torch.randn(6 * size, generator=torch.Generator().manual_seed(r), dtype=dtype)

                work, mine = comm.reduce_scatter_in_place(inputs(rank), group, async_op=async_op)
                assert (work is None) != async_op
                if work is not None:
                    work.wait()
                expected = inputs(ranks[0])
                for r in ranks[1:]:
                    expected = expected + inputs(r)
                torch.testing.assert_close(mine, expected[6 * me : 6 * (me + 1)], rtol=0, atol=0)
            # bf16 pieces summed in fp32 (stages 2/3 with bf16 params): the bits of the fp32 reduction of the
            # widened inputs, while the pieces travel as bf16
            wide = torch.empty(6, dtype=torch.float64 if dtype == torch.float32 else torch.float32)
            work, summed = comm.reduce_scatter_in_place(inputs(rank), group, async_op=True, sum_into=wide)
            work.wait()
            assert summed is wide
            _, reference = comm.reduce_scatter_in_place(inputs(rank).to(wide.dtype), group)
            torch.testing.assert_close(wide, reference, rtol=0, atol=0)
    groups.destroy()


def _check_all_gather():
    """Over groups of 4 and 2, fp32 and bf16: each member's input lands in its slice, from a separate tensor or
    from the output's own slice (in place), with two gathers of different sizes in flight on one group at once
    (gloo runs them as peer exchanges: each must receive its own messages)."""
    rank = dist.get_rank()
    groups = ParallelGroups.build(expert_parallel_size=2)
    members = {groups.dp: [0, 1, 2, 3], groups.ep: [rank - rank % 2, rank - rank % 2 + 1]}
    assert all(comm.receives_pieces(g) for g in members)
    for group, ranks in members.items():
        size, me = len(ranks), ranks.index(rank)
        for dtype in (torch.float32, torch.bfloat16):

            def inputs(r, n):
                return torch.randn(n, generator=torch.Generator().manual_seed(1000 * n + r), dtype=dtype)

            expected = {n: torch.cat([inputs(r, n) for r in ranks]) for n in (5, 7)}
            apart = torch.zeros(5 * size, dtype=dtype)
            in_place = torch.zeros(7 * size, dtype=dtype)
            in_place[7 * me : 7 * (me + 1)] = inputs(rank, 7)
            works = [
                comm.all_gather(apart, inputs(rank, 5), group, async_op=True),
                comm.all_gather(in_place, in_place[7 * me : 7 * (me + 1)], group, async_op=True),
            ]
            for work in reversed(works):
                work.wait()
            torch.testing.assert_close(apart, expected[5], rtol=0, atol=0)
            torch.testing.assert_close(in_place, expected[7], rtol=0, atol=0)
            out = torch.zeros(3 * size, 2, dtype=dtype)  # 2-D: rows of each member, as hf.save gathers experts
            assert comm.all_gather(out, torch.full((3, 2), float(rank), dtype=dtype), group) is None
            torch.testing.assert_close(out, torch.tensor(ranks, dtype=dtype).repeat_interleave(6).view(-1, 2))
    groups.destroy()


def _rank_values(r, dtype):
    """Rank r's values; the last one sums differently in another order (1 + half an ulp, three times)."""
    if not dtype.is_floating_point:
        return torch.tensor([7, -3, r + 1, r % 3, -r, 2 * r, 5 - r, 10**12 * r], dtype=dtype)
    half_ulp = torch.finfo(dtype).eps / 2
    return torch.tensor([1e3, -3.0, 0.1 * (r + 1), r % 3, -r, 2.5 * r, 5 - r, 1.0 if r == 0 else half_ulp], dtype=dtype)


def _check_small_all_reduce(local_records):
    """Short all-reduces (through the control group's pipes, or on gloo as an all-gather, each rank reducing the
    copies): SUM / MAX / MIN equal the values reduced here, the sum in rank order bit for bit (another order
    rounds 1 + 3 half ulps otherwise), the same on every rank; waited in slices of a timeout and resumed, as
    watched waits do; a NaN wins MAX and MIN; a long tensor still takes gloo's all-reduce, and on gloo a single
    flag too."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = ParallelGroups.build(expert_parallel_size=1, local_records=local_records)
    sums = []
    for dtype in (torch.int64, torch.float64, torch.float32, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            x, ordered = _rank_values(rank, dtype), _rank_values(0, dtype)
            assert comm.small_reduce.reduces_small(x, groups.control, op)
            if op == dist.ReduceOp.SUM:
                for r in range(1, world):
                    ordered.add_(_rank_values(r, dtype))
            else:
                ordered = torch.stack([_rank_values(r, dtype) for r in range(world)])
                ordered = ordered.amax(0) if op == dist.ReduceOp.MAX else ordered.amin(0)
            work = comm.all_reduce(x, groups.control, op=op, async_op=True)
            if rank == 0:
                try:  # the peers are still behind the barrier: the slice times out, a later wait resumes
                    work.wait(datetime.timedelta(milliseconds=1))
                except RuntimeError:
                    pass
                dist.barrier(groups.dp)
            else:
                dist.barrier(groups.dp)
            work.wait()
            assert work.is_completed()
            assert torch.equal(x, ordered), (dtype, op, x, ordered)
            if op == dist.ReduceOp.SUM:
                sums.append(x.tolist())
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        x = torch.tensor([float("nan") if rank == 1 else 1.0, float(rank)] * world)
        comm.all_reduce(x, groups.control, op=op)
        assert x[0].isnan() and x[1] == (world - 1 if op == dist.ReduceOp.MAX else 0)
    long, flag = torch.full((64 * 1024,), float(rank)), torch.tensor([float(rank)])
    assert not comm.small_reduce.reduces_small(long, groups.control, dist.ReduceOp.SUM)
    assert comm.small_reduce.reduces_small(flag, groups.control, dist.ReduceOp.SUM) == local_records
    comm.all_reduce(long, groups.control)
    assert torch.equal(long, torch.full_like(long, sum(range(world))))
    groups.destroy()
    return sums


def _check_count_exchange(local_records):
    """Row j of each rank's table goes to rank j of its ep group (through the ep group's pipes on one host)."""
    for ep in (2, 4):
        groups = ParallelGroups.build(expert_parallel_size=ep, local_records=local_records)
        assert (getattr(transport_of(groups.ep), "pipes", None) is not None) == local_records
        me = dist.get_rank(groups.ep)
        table = torch.tensor([[100 * dist.get_rank() + j, j, -me] for j in range(ep)])
        for waited_by in (None, lambda work: work.wait()):
            got = comm.launch_exchange_counts(table, groups.ep, waited_by).wait()
            members = rank_layout(4, ep).ep_group_of(dist.get_rank())
            assert got.tolist() == [[100 * members[i] + me, me, -i] for i in range(ep)], (ep, got)
        groups.destroy()


def _each_collective(group):
    """Every kind of collective comm.py runs, twice, on `group`."""
    size, me = comm.group_size(group), comm.group_rank(group)
    for _ in range(2):
        comm.all_reduce(torch.ones(2 * size), group)
        comm.all_reduce(torch.ones(1), group, op=dist.ReduceOp.MAX)
        comm.all_gather(torch.empty(3 * size), torch.ones(3), group)
        comm.reduce_scatter_in_place(torch.ones(3 * size), group)
        comm.exchange_counts(torch.ones(size, 2, dtype=torch.int64), group)
        comm.all_to_all(torch.ones(size, 2), [1] * size, [1] * size, group)
        comm.broadcast(torch.full((2,), float(me)), dist.get_global_rank(group, 0), group)


def _check_transports_chosen_once():
    """A group's transport is chosen once: the groups ParallelGroups builds on one host are served (pipes, rings)
    as they are made, so no default is ever chosen for them; a group served nothing (another host's layout, a
    test's own group) gets its backend's default on its first collective and keeps it, whatever runs after."""
    chosen = []
    default = transport.default_transport
    transport.default_transport = lambda group: chosen.append(group) or default(group)
    try:
        for local_records in (True, False):
            groups = ParallelGroups.build(expert_parallel_size=2, local_records=local_records)
            own = dist.new_group(list(range(dist.get_world_size())))
            every = (groups.dp, groups.ep, groups.edp, groups.control, own)
            for group in every:
                _each_collective(group)
            served = [g for g in every if isinstance(transport_of(g), LocalTransport)]
            assert (len(served) >= 3) == local_records  # dp, ep, control: pipes (edp's rings: x86 hosts)
            assert all(chosen.count(g) == (g not in served) for g in every), (local_records, chosen)
            assert type(transport_of(own)) is GlooTransport
            chosen.clear()
            groups.destroy()
            dist.destroy_process_group(own)
    finally:
        transport.default_transport = default


def _check_collectives(hidden):
    _check_transports_chosen_once()
    _check_reduce_scatter()
    _check_all_gather()
    for local_records in (True, False):
        _check_count_exchange(local_records)
    sums = [_check_small_all_reduce(local_records) for local_records in (True, False)]
    assert sums[0] == sums[1]  # the pipes' sums, bit for bit gloo's
    return sums[0], _check_all_to_all(hidden)


def test_all_to_all_uneven_splits_forward_and_backward_and_reduce_scatter_and_all_gather():
    results = run_distributed(_check_collectives, 4, 3)
    assert all(sums == results[0][0] for sums, _ in results)  # the same bits on every rank
    assert [size for _, size in results] == [sum(SEND_COUNTS[i][j] for i in range(4)) for j in range(4)]


def test_world_of_one_is_identity():
    x = torch.randn(5, 3, requires_grad=True)
    assert comm.all_to_all(x, [5], [5], None) is x
    work, mine = comm.reduce_scatter_in_place(x.detach().reshape(-1), None)
    assert work is None
    torch.testing.assert_close(mine.view(5, 3), x.detach())


def test_a_group_nobody_released_is_not_kept_alive_by_its_transport():
    """The map of transports is keyed weakly on the group: a transport holding its group strongly kept a destroyed
    group (and its gloo connections) alive until released by hand."""
    code = (
        "import gc, tempfile, weakref, torch, torch.distributed as dist\n"
        "from moezero.parallel import comm\n"
        "from moezero.parallel.transport import transport_of\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
        "g = dist.new_group([0])\n"
        "transport_of(g)\n"
        "ref = weakref.ref(g)\n"
        "dist.destroy_process_group(g); del g; gc.collect()\n"
        "print('alive' if ref() is not None else 'freed')\n"
    )
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "freed", out.stdout + out.stderr
