"""The token all-to-alls and ZeRO's bucket exchanges through shared memory between ranks on one host
(`moezero/parallel/local_exchange.py`):
the same bytes as gloo's all-to-all for uneven splits (empty ones too), by ring, by gloo send and receive, and by
a receive posted late when a ring is full (with the peers busy elsewhere meanwhile: nobody waits for a reader),
waited in any order; nothing left in /dev/shm; a peer that exits is an error at once; a peer that never waits
(it raised) leaves no sender waiting for it."""

import glob
import platform
import tempfile

import pytest
import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups, comm, local_channel, local_exchange
from moezero.parallel.transport import transport_of
from tests.dist_utils import run_distributed


def _rings(group):
    """The group's shared-memory rings (its transport's), or None."""
    return getattr(transport_of(group), "rings", None)


def _pipes(group):
    return getattr(transport_of(group), "pipes", None)


def _names():
    return {n for folder in ("/dev/shm", tempfile.gettempdir()) for n in glob.glob(f"{folder}/moezero-rows-*")}


def _splits(world, step):
    """send[i][j]: rows rank i sends rank j (some zero)."""
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, 6, (world, world), generator=g) * (torch.rand(world, world, generator=g) > 0.2)).tolist()


def _rows(rank, step, n, width, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(n, width, generator=g) * 100).to(dtype)


def _exchange_cases(out, rank):
    world = dist.get_world_size()
    names = _names()
    piped = ParallelGroups.build(expert_parallel_size=world)
    gloo = ParallelGroups.build(expert_parallel_size=world, local_records=False)
    exchange = _rings(piped.ep)
    out["built"] = exchange is not None and _rings(gloo.ep) is None
    out["sizes"] = [local_exchange.ring_bytes(n) >> 10 for n in (2, 3, 9, 200)]
    out["no names left"] = _names() <= names
    equal = []
    for limit in (exchange.limit, 64):  # 64 bytes: most messages by gloo send and receive
        exchange.limit = limit
        works = []
        for step, (width, dtype) in enumerate([(7, torch.float32), (5, torch.bfloat16), (3, torch.int64)] * 3):
            send = _splits(world, step)
            x = _rows(rank, step, sum(send[rank]), width, dtype)
            recv = [send[i][rank] for i in range(world)]
            got = torch.empty(sum(recv), width, dtype=dtype)
            works.append((transport_of(piped.ep).all_to_all(got, x, recv, send[rank]), got, x, recv, send[rank]))
        for work, got, x, recv, sent in reversed(works):  # waited in reverse: rings free out of order
            work.wait()
            want = torch.empty_like(got)
            dist.all_to_all_single(want, x, recv, sent, group=gloo.ep)
            equal.append(torch.equal(got, want))
    out["equal"] = equal
    exchange.limit = local_exchange.ring_bytes(world) // 8
    ring = exchange.outgoing[(exchange.me + 1) % world]
    full = []  # 20 messages of 600 KB in flight: the ring (8 MB at 3 ranks) fills, the rest go as late gloo receives
    for step in range(20):
        x = torch.full((world * 600, 256), float(rank + step), dtype=torch.float32).view(-1, 256)[: world * 600]
        got = torch.empty_like(x)
        full.append((transport_of(piped.ep).all_to_all(got, x, [600] * world, [600] * world), got, step))
    out["ring filled"] = int(ring.freed_word.item()) < ring.head - ring.capacity // 2
    dist.barrier(gloo.dp)
    ok = True
    for work, got, step in full:
        work.wait()
        ok = ok and all(
            torch.equal(part, torch.full_like(part, float(r + step))) for r, part in enumerate(got.split(600))
        )
    out["full ring"] = ok
    dist.barrier(gloo.dp)  # the peer frees this rank's spans in its own waits (no wait here waits for it)
    out["ring freed"] = int(ring.freed_word.item()) == ring.head
    if rank == 1:  # as if it exited: its pipes close, rank 0 knows at its next wait
        _pipes(piped.ep).close()
    else:
        x = torch.ones(world, 4)
        work = transport_of(piped.ep).all_to_all(torch.empty_like(x), x, [1] * world, [1] * world)
        dist.barrier(gloo.dp)
        try:
            work.wait()
        except local_channel.ChannelError as exc:
            out["peer gone"] = str(exc)
    if rank == 1:
        dist.barrier(gloo.dp)
    dist.barrier(gloo.dp)
    piped.destroy()
    gloo.destroy()


def _bucket_cases(out, rank):
    """ZeRO's bucket reduce-scatters and all-gathers on the dp group: through rings of their own, the same bits as
    the point-to-point gloo path (sums in rank order either way), with messages by ring, by gloo (over the limit)
    and by late receive (ring full); their notices never pair with the group's short all-reduces, which the ranks
    issue here in different orders around them."""
    world, names = dist.get_world_size(), _names()
    piped = ParallelGroups.build(expert_parallel_size=world)
    gloo = ParallelGroups.build(expert_parallel_size=world, local_records=False)
    exchange = _rings(piped.dp)
    out["bucket rings"] = (
        exchange is not None
        and exchange.channel is not _pipes(piped.dp)
        and _rings(gloo.dp) is None
        and _rings(piped.edp) is None
    )
    out["bucket ring kB"] = exchange.outgoing[(rank + 1) % world].capacity >> 10
    wide = ParallelGroups.build(expert_parallel_size=1)  # experts reduced over every rank: their rings too
    out["edp rings"] = _rings(wide.edp) is not None and _rings(wide.edp) is not exchange
    # stage 3's gather groups (made on first use): rings of their own, none between hosts' settings
    gathers = [_rings(group) for group in wide.gather_groups()]
    out["gather rings"] = (
        None not in gathers
        and len({id(e) for e in gathers + [exchange]}) == 3
        and [_rings(group) for group in gloo.gather_groups()] == [None, None]
    )
    wide.destroy()
    equal = []
    for limit in (exchange.limit, 256):  # 256 bytes: most messages by gloo send and receive
        exchange.limit = limit
        for step, (n, dtype) in enumerate([(3 * 4096, torch.float32), (3 * 1000, torch.bfloat16), (3, torch.float64)]):
            g = torch.Generator().manual_seed(step * 10 + rank)
            grads = (torch.randn(n, generator=g) * 10).to(dtype)
            got = [None, None]
            for slot, groups in enumerate((piped, gloo)):
                source = grads.clone()
                if rank == 1:  # a short all-reduce on the dp group before the launch here, after it elsewhere
                    comm.all_reduce(torch.ones(2), groups.dp)
                work, mine = comm.reduce_scatter_in_place(
                    source,
                    groups.dp,
                    async_op=True,
                    sum_into=torch.empty(n // world) if dtype == torch.bfloat16 else None,
                )
                if rank != 1:
                    comm.all_reduce(torch.ones(2), groups.dp)
                work.wait()
                gathered = torch.empty(n, dtype=dtype)
                comm.all_gather(gathered, mine.to(dtype), groups.dp)
                got[slot] = (mine.clone(), gathered)
            equal.append(torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]))
    out["bucket equal"] = equal
    exchange.limit = local_exchange.BUCKETS.ring_bytes(world) // local_exchange.BUCKETS.largest_share
    ring = exchange.outgoing[(rank + 1) % world]
    in_flight = []  # 12 reduce-scatters of 3 x 1.5 MB: the 16 MB ring fills, the rest go as late gloo receives
    for step in range(12):
        in_flight.append(
            comm.reduce_scatter_in_place(torch.full((world * 393216,), float(rank + step)), piped.dp, async_op=True)
        )
    out["bucket ring filled"] = int(ring.freed_word.item()) < ring.head - ring.capacity // 2
    dist.barrier(gloo.dp)
    out["bucket full ring"] = all(
        work.wait() and torch.equal(mine, torch.full_like(mine, float(sum(range(world)) + world * step)))
        for step, (work, mine) in enumerate(in_flight)
    )
    piped.destroy()
    gloo.destroy()
    out["bucket names left"] = bool(_names() - names)


def _late_send_cases(out, rank):
    """A message that finds its ring full goes as a gloo send whose receive the peer posts when it waits: a peer
    that raised before waiting never posts it, so the sender's own wait must not wait for that send (it did, and
    a rank that raised mid-forward at stage 3 left its peer waiting for ever). Rank 1's ring to rank 0 is filled
    with bytes rank 0 never reads; rank 0 launches the exchange and never waits for it."""
    world = dist.get_world_size()
    piped = ParallelGroups.build(expert_parallel_size=world)
    exchange = _rings(piped.ep)
    if rank == 1:
        ring = exchange.outgoing[0]
        ring.place(torch.zeros(ring.capacity, dtype=torch.uint8))
    x = torch.full((world * 4, 2), float(rank))
    got = torch.empty_like(x)
    work = transport_of(piped.ep).all_to_all(got, x, [4] * world, [4] * world)
    if rank != 0:
        work.wait()
        out["late send"] = all(
            torch.equal(part, torch.full_like(part, float(r))) for r, part in enumerate(got.split(4))
        )
    dist.barrier()  # the world is torn down after (rank 1's send to rank 0 never completes)


def _cases():
    out = {}
    _bucket_cases(out, dist.get_rank())
    _exchange_cases(out, dist.get_rank())
    _late_send_cases(out, dist.get_rank())
    return out


@pytest.mark.skipif(
    platform.machine().lower() not in local_exchange._ORDERED_STORES,
    reason="shared-memory rings only on x86 hosts (gloo elsewhere)",
)
def test_local_exchange_matches_gloo_and_reports_gone_peers():
    results = run_distributed(_cases, 3, isolated=True, timeout=180)
    for rank, out in enumerate(results):
        assert out["built"] and out["no names left"], out
        assert out["sizes"] == [8192, 8192, 4096, 256], out["sizes"]
        assert out["equal"] == [True] * 18, out["equal"]
        assert out["ring filled"] and out["full ring"] and out["ring freed"], out
        assert out["bucket rings"] and out["edp rings"] and out["bucket ring kB"] == 16384, out
        assert out["gather rings"], out
        assert out["bucket equal"] == [True] * 6, out["bucket equal"]
        assert out["bucket ring filled"] and out["bucket full ring"] and not out["bucket names left"], out
    assert "rank 1" in results[0]["peer gone"] and "exited" in results[0]["peer gone"], results[0]
    assert [out.get("late send") for out in results] == [None, True, True]
