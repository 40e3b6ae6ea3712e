"""The token all-to-alls through shared memory between ranks on one host (`moezero/parallel/local_exchange.py`):
the same bytes as gloo's all-to-all for uneven splits (empty ones too), by ring, by gloo send and receive, and by
a receive posted late when a ring is full (with the peers busy elsewhere meanwhile: nobody waits for a reader),
waited in any order; nothing left in /dev/shm; a peer that exits is an error at once."""
import glob
import platform
import tempfile

import pytest
import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups, local_channel, local_exchange
from tests.dist_utils import run_distributed


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
    exchange = local_exchange.of(piped.ep)
    out["built"] = exchange is not None and local_exchange.of(gloo.ep) is None
    out["sizes"] = [local_exchange.ring_bytes(n) >> 10 for n in (2, 3, 9, 200)]
    out["no names left"] = _names() <= names
    equal = []
    for limit in (exchange.limit, 64):   # 64 bytes: most messages by gloo send and receive
        exchange.limit = limit
        works = []
        for step, (width, dtype) in enumerate([(7, torch.float32), (5, torch.bfloat16), (3, torch.int64)] * 3):
            send = _splits(world, step)
            x = _rows(rank, step, sum(send[rank]), width, dtype)
            recv = [send[i][rank] for i in range(world)]
            got = torch.empty(sum(recv), width, dtype=dtype)
            works.append((exchange.launch(got, x, recv, send[rank], piped.ep), got, x, recv, send[rank]))
        for work, got, x, recv, sent in reversed(works):   # waited in reverse: rings free out of order
            work.wait()
            want = torch.empty_like(got)
            dist.all_to_all_single(want, x, recv, sent, group=gloo.ep)
            equal.append(torch.equal(got, want))
    out["equal"] = equal
    exchange.limit = local_exchange.ring_bytes(world) // 8
    ring = exchange.outgoing[(exchange.me + 1) % world]
    full = []   # 20 messages of 600 KB in flight: the ring (8 MB at 3 ranks) fills, the rest go as late gloo receives
    for step in range(20):
        x = torch.full((world * 600, 256), float(rank + step), dtype=torch.float32).view(-1, 256)[: world * 600]
        got = torch.empty_like(x)
        full.append((exchange.launch(got, x, [600] * world, [600] * world, piped.ep), got, step))
    out["ring filled"] = int(ring.freed_word.item()) < ring.head - ring.capacity // 2
    dist.barrier(gloo.dp)
    ok = True
    for work, got, step in full:
        work.wait()
        ok = ok and all(torch.equal(part, torch.full_like(part, float(r + step)))
                        for r, part in enumerate(got.split(600)))
    out["full ring"] = ok
    out["ring freed"] = int(ring.freed_word.item()) == ring.head
    if rank == 1:   # as if it exited: its pipes close, rank 0 knows at its next wait
        local_channel.of(piped.ep).close()
    else:
        x = torch.ones(world, 4)
        work = exchange.launch(torch.empty_like(x), x, [1] * world, [1] * world, piped.ep)
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


def _cases():
    out = {}
    _exchange_cases(out, dist.get_rank())
    return out


@pytest.mark.skipif(platform.machine().lower() not in local_exchange._ORDERED_STORES,
                    reason="shared-memory rings only on x86 hosts (gloo elsewhere)")
def test_local_exchange_matches_gloo_and_reports_gone_peers():
    results = run_distributed(_cases, 3, isolated=True, timeout=180)
    for rank, out in enumerate(results):
        assert out["built"] and out["no names left"], out
        assert out["sizes"] == [8192, 8192, 4096, 256], out["sizes"]
        assert out["equal"] == [True] * 18, out["equal"]
        assert out["ring filled"] and out["full ring"] and out["ring freed"], out
    assert "rank 1" in results[0]["peer gone"] and "exited" in results[0]["peer gone"], results[0]
