"""The agreement records' pipes between ranks on one host (`moezero/parallel/local_channel.py`): messages pair by
index and arrive async, a peer that exits is known at once (also with a forked child alive), one that never
writes at the group's timeout, and a world that cannot share pipes keeps gloo on every rank."""

import datetime
import glob
import os
import tempfile
import time

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups, comm, local_channel
from moezero.parallel.agreement import Agreement, RanksDisagree, watched_wait
from moezero.parallel.transport import transport_of
from tests.dist_utils import run_distributed


def _pipes(group):
    """The group's pipes (its transport's), or None."""
    return getattr(transport_of(group), "pipes", None)


def _names():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "moezero-records-*")))


def _messages_pair_by_index(out, rank):
    names = _names()
    group = ParallelGroups.build().agreement_group()
    channel = _pipes(group)
    out["channel"] = channel is not None
    out["gloo when asked"] = _pipes(ParallelGroups.build(local_records=False).agreement_group()) is None
    out["no names left"] = _names() <= names
    if rank == 0:  # three messages ahead of rank 1: none has its pair yet
        indices = [channel.post(f"zero {i}".encode()) for i in range(3)]
        out["arrived early"] = channel.arrived(indices[0])
        dist.barrier(group)
    else:
        dist.barrier(group)
        indices = [channel.post(f"one {i}".encode()) for i in range(3)]
    out["messages"] = [channel.wait(i) for i in indices]
    agreement = Agreement([[4, 2]], group, str, flag=7 * rank)
    agreement.check()
    out["flag"] = agreement.flag_anywhere


def _timeout_and_exit(out, rank):
    groups = ParallelGroups.build(timeout=datetime.timedelta(seconds=2))
    group = groups.agreement_group()
    if rank == 0:  # rank 1 never states this record
        start = time.monotonic()
        try:
            Agreement([[5]], group, lambda record: "was ending a backward").check()
        except RanksDisagree as exc:
            out["timeout"], out["waited"] = str(exc), time.monotonic() - start
    dist.barrier()
    group = ParallelGroups.build(timeout=datetime.timedelta(seconds=60)).agreement_group()
    channel = _pipes(group)
    if rank == 1:  # a forked child (a data loader's worker) holds no pipe: closing ours is an exit seen at once
        child = os.fork()
        if child == 0:
            os._exit(0 if not channel.readers and not channel.writers else 3)
        channel.post(b"last")
        channel.close()
        out["child"] = os.waitpid(child, 0)[1]
        dist.barrier()
    else:
        first = channel.post(b"first")
        dist.barrier()
        out["last"] = channel.wait(first)
        start = time.monotonic()
        try:
            channel.wait(channel.post(b"next"))
        except local_channel.ChannelError as exc:
            out["exit"], out["exit waited"] = str(exc), time.monotonic() - start


def _worlds_without_pipes(out, rank, monkeypatch_host):
    names = _names()
    if monkeypatch_host:  # rank 1 on another machine
        original = local_channel._host_identity
        local_channel._host_identity = lambda: "elsewhere" if rank == 1 else original()
    else:  # rank 1 cannot make pipes here (another temp directory, a read-only one)
        original = os.mkfifo

        def refuse(*args, **kwargs):
            raise PermissionError("read-only")

        os.mkfifo = refuse if rank == 1 else original
    try:
        group = ParallelGroups.build().agreement_group()
    finally:
        if monkeypatch_host:
            local_channel._host_identity = original
        else:
            os.mkfifo = original
    out["channel", monkeypatch_host] = _pipes(group) is not None
    Agreement([[1, rank % 1]], group, str).check()  # the records travel on gloo instead
    out["no names left", monkeypatch_host] = _names() <= names


def _high_descriptors(out, rank):
    """A process with many groups and files: the pipes' descriptors above 1024 (select's limit) still wait."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        out["high"] = "skipped"
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        channel = _pipes(ParallelGroups.build().agreement_group())
        out["high fds"] = min(channel.readers.values()) > 1024
        if rank == 1:
            time.sleep(0.3)  # rank 0 blocks in the wait meanwhile
        out["high"] = channel.wait(channel.post(b"x%d" % rank))
    finally:
        for fd in fillers:
            os.close(fd)


def _short_all_reduces(out, rank):
    """The dp and control groups' short all-reduces travel through pipes too: the same values as gloo's, any
    length and dtype; a wait in slices (a watched wait) resumes; a peer that never comes ends it at the timeout."""
    groups = ParallelGroups.build(timeout=datetime.timedelta(seconds=2))
    out["short piped"] = all(_pipes(g) is not None for g in (groups.dp, groups.control))
    values = {}
    for name, x, op in (
        ("sum", torch.tensor([0.1 * (rank + 1), 1e16, -rank], dtype=torch.float64), "SUM"),
        ("flag", torch.tensor([float(rank)]), "MIN"),
        ("max", torch.tensor([[rank, 7 - rank]], dtype=torch.int64), "MAX"),
        ("bf16", torch.tensor([1.5 + rank, 3.0], dtype=torch.bfloat16), "SUM"),
    ):
        assert comm.small_reduce.reduces_small(x, groups.control, getattr(dist.ReduceOp, op))
        comm.all_reduce(x, groups.control, op=getattr(dist.ReduceOp, op))
        values[name] = x.tolist()
    out["short values"] = values
    x = torch.tensor([1.0, rank])
    if rank == 1:
        time.sleep(0.2)
    work = comm.all_reduce(x, groups.dp, async_op=True)
    slices = 0
    while True:
        try:
            work.wait(datetime.timedelta(milliseconds=20))
            break
        except RuntimeError:
            slices += 1
    out["sliced"] = (x.tolist(), slices)
    if rank == 0:  # rank 1 never joins this one
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(2), groups.control)
        except RuntimeError as exc:
            out["short timeout"] = (str(exc), time.monotonic() - start)
    dist.barrier()


def _full_pipes_and_deadlines(out, rank):
    """Both ranks post far more than a pipe holds before waiting (small buckets all launched before any wait):
    each reads while its writes wait for room, so both get through. A watched wait of a piped reduce whose peer
    never comes ends at the group's timeout from its launch, not later; a closed channel says so."""
    group = ParallelGroups.build(timeout=datetime.timedelta(seconds=10)).agreement_group()
    channel = _pipes(group)
    indices = [channel.post(bytes([rank, i % 256]) * 512) for i in range(300)]  # 300 KiB each way
    out["full pipes"] = all(channel.wait(i) == [bytes([0, i % 256]) * 512, bytes([1, i % 256]) * 512] for i in indices)
    groups = ParallelGroups.build(timeout=datetime.timedelta(seconds=2))
    if rank == 0:  # rank 1 never joins
        start = time.monotonic()
        work = comm.all_reduce(torch.ones(2), groups.control, async_op=True)
        try:
            watched_wait(work, lambda: None)
        except local_channel.ChannelError as exc:
            out["deadline"] = (str(exc), time.monotonic() - start)
    dist.barrier()
    channel.close()
    try:
        channel.post(b"late")
    except local_channel.ChannelError as exc:
        out["closed"] = str(exc)


def _channel_cases():
    rank, out = dist.get_rank(), {}
    _full_pipes_and_deadlines(out, rank)
    _short_all_reduces(out, rank)
    _high_descriptors(out, rank)
    _messages_pair_by_index(out, rank)
    _timeout_and_exit(out, rank)
    for monkeypatch_host in (True, False):
        _worlds_without_pipes(out, rank, monkeypatch_host)
    return out


def test_local_channel_pairs_messages_and_reports_missing_peers():
    results = run_distributed(_channel_cases, 2, isolated=True, timeout=120)
    for rank, out in enumerate(results):
        assert out["channel"] and out["gloo when asked"] and out["no names left"], out
        assert out["messages"] == [[f"zero {i}".encode(), f"one {i}".encode()] for i in range(3)], out["messages"]
        assert out["flag"] == 7
        for host in (True, False):
            assert out["channel", host] is False and out["no names left", host], (rank, host, out)
    assert results[0]["arrived early"] is False
    for out in results:
        assert out["full pipes"] and "pipes were closed" in out["closed"], out
    message, waited = results[0]["deadline"]
    assert "control group" in message and 1.9 <= waited < 3.5, (message, waited)
    for out in results:
        assert out["short piped"], out
        assert out["short values"] == {
            "sum": [0.1 + 0.2, 2e16, -1.0],
            "flag": [0.0],
            "max": [[1, 7]],
            "bf16": [4.0, 6.0],
        }, out["short values"]
        assert out["sliced"][0] == [2.0, 1.0], out["sliced"]
    assert results[0]["sliced"][1] >= 3  # rank 0 waited ~0.2 s in 20 ms slices, then had its sum
    message, waited = results[0]["short timeout"]
    assert "no message" in message and "control group" in message and 1.9 <= waited < 30, (message, waited)
    for out in results:
        assert out["high"] == "skipped" or out["high fds"] and out["high"] == [b"x0", b"x1"], out["high"]
    assert "rank 0 was ending a backward" in results[0]["timeout"] and "not every other rank" in results[0]["timeout"]
    assert "no message 0 from rank 1" in results[0]["timeout"] and "timeout (2 s)" in results[0]["timeout"]
    assert 1.9 <= results[0]["waited"] < 30, results[0]["waited"]
    assert results[1]["child"] == 0  # the forked child had closed its copies of the pipes
    assert results[0]["last"] == [b"first", b"last"]  # what a peer sent before it exited still counts
    assert "rank 1 of the agreement group exited" in results[0]["exit"], results[0]["exit"]
    assert results[0]["exit waited"] < 30, results[0]["exit waited"]  # at once, not at the 60 s timeout
