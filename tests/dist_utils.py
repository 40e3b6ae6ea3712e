"""Run test functions on N gloo ranks.

`run_distributed(fn, world_size, *args)` calls `fn(*args)` on every rank of a spawned gloo
world and returns the per-rank results (rank order). Spawning and importing torch is the
slow part on 2 cores, so a world of each size is kept alive and reused by later calls; any
failure or hang tears it down, so the next call starts from a fresh world.

- A failure on any rank fails the call with that rank's traceback.
- A rank that does not finish within `timeout` fails the call with a message naming the
  stuck ranks; every process of that world is killed.
- `fn` must be importable (a module-level function) and its arguments and result picklable.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List

DEFAULT_TIMEOUT_S = 120.0
ERROR_GRACE_S = 5.0  # after one rank fails, how long the others get to report before the kill


class DistributedTestError(AssertionError):
    pass


class RankPool:
    """N spawned processes in one gloo world, each running tasks from its queue."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._tmpdir = tempfile.TemporaryDirectory(prefix="moezero-dist-")
        init_file = os.path.join(self._tmpdir.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._ids = itertools.count()
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children: one thread per rank
        try:
            self.procs = [
                ctx.Process(
                    target=_worker,
                    name=f"moezero-rank{r}",
                    daemon=True,
                    args=(r, world_size, init_file, self._tasks[r], self._results),
                )
                for r in range(world_size)
            ]
            for p in self.procs:
                p.start()
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = saved

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> List[Any]:
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs, timeout))
        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in results and r not in errors]
            for r in dead:
                errors[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
            if errors:  # the others get a short grace to report, then the world is killed
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                tid, rank, status, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if tid != task_id:
                continue  # a stale report from an earlier, abandoned task
            (results if status == "ok" else errors)[rank] = payload
        stuck = [r for r in range(self.world_size) if r not in results and r not in errors]
        if errors or stuck:
            self.close()
            raise DistributedTestError(_failure_message(fn, errors, stuck, timeout))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._tasks:
            try:
                q.put_nowait(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=0.5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for q in self._tasks + [self._results]:
            q.cancel_join_thread()
            q.close()
        self._tmpdir.cleanup()

    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]


def _failure_message(fn: Callable, errors: Dict[int, str], stuck: List[int], timeout: float) -> str:
    lines = [f"{fn.__module__}.{fn.__qualname__} failed:"]
    for rank in sorted(errors):
        lines.append(f"--- rank {rank} ---\n{errors[rank]}")
    if stuck:
        reason = "after another rank failed" if errors else f"within {timeout:.0f}s (hung?)"
        lines.append(f"ranks {stuck} did not finish {reason}; all ranks were killed")
    return "\n".join(lines)


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=600),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs, timeout = task
        groups_before = set(_live_groups())
        # a rank still running just before the caller gives up prints where each of its threads is (stderr, which
        # the test's report shows): a hang names its place
        faulthandler.dump_traceback_later(max(timeout - 2.0, 1.0))
        try:
            out = fn(*args, **kwargs)
            results.put((task_id, rank, "ok", out))
        except BaseException:
            results.put((task_id, rank, "error", traceback.format_exc()))
        finally:
            faulthandler.cancel_dump_traceback_later()
            for group in set(_live_groups()) - groups_before:
                dist.destroy_process_group(group)
    dist.destroy_process_group()


def _live_groups():
    from torch.distributed import distributed_c10d as c10d

    return [g for g in c10d._world.pg_map if g is not c10d.GroupMember.WORLD]


_POOLS: Dict[int, RankPool] = {}


def run_distributed(
    fn: Callable,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
    isolated: bool = False,
    **kwargs,
) -> List[Any]:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return each rank's result, in rank order.

    fresh=True starts new processes (for tests sensitive to what earlier tests left behind, such as
    the profiler's memory accounting); isolated=True also kills them afterwards (for tests that leave
    collectives no peer will ever join, such as ranks made to disagree).
    """
    pool = _POOLS.get(world_size)
    if pool is None or fresh or isolated or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except DistributedTestError:
        _POOLS.pop(world_size, None)
        raise
    finally:
        if isolated and _POOLS.get(world_size) is pool:
            _POOLS.pop(world_size).close()


def live_pool_pids(world_size: int) -> List[int]:
    pool = _POOLS.get(world_size)
    return pool.pids() if pool is not None else []


def close_all_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(close_all_pools)


def assert_replicas_equal(module, groups) -> None:
    """Inside a rank: every replicated param and buffer is bitwise equal on all its replicas.

    Dense tensors are replicated over `dp`, routed-expert tensors over `edp`.
    """
    import torch

    from moezero.parallel import comm, is_expert_parallel

    tensors = list(module.named_parameters()) + list(module.named_buffers())
    for name, tensor in tensors:
        group = groups.edp if is_expert_parallel(tensor) else groups.dp
        size = comm.group_size(group)
        if size == 1:
            continue
        local = tensor.detach().contiguous().view(-1).view(torch.uint8)
        gathered = torch.empty(size * local.numel(), dtype=torch.uint8)
        comm.all_gather(gathered, local, group)
        for r, replica in enumerate(gathered.view(size, -1)):
            if not torch.equal(replica, local):
                raise AssertionError(f"{name} differs between this rank and rank {r} of its replica group")
