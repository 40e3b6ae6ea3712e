"""The harness itself: results come back in rank order, failures carry the failing rank's
traceback, hangs are reported by rank, and no process outlives a failure."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import DistributedTestError, live_pool_pids, run_distributed


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise RuntimeError("boom from rank one")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def _hang_on_rank_one():
    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); read its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_results_in_rank_order_with_one_thread_per_rank():
    results = run_distributed(_rank_and_sum, 2)
    assert [r[0] for r in results] == [0, 1]
    assert all(r[1] == 3.0 for r in results)
    assert all(r[2] == "1" and r[3] == 1 for r in results)


def test_failing_rank_reports_its_traceback_and_kills_the_world():
    run_distributed(_rank_and_sum, 2)
    pids = live_pool_pids(2)
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_fail_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "--- rank 1 ---" in message and "boom from rank one" in message
    assert "ranks [0] did not finish after another rank failed" in message
    assert not any(_alive(p) for p in pids)
    assert [r[0] for r in run_distributed(_rank_and_sum, 2)] == [0, 1]  # a fresh world works


def test_hanging_rank_is_named_and_killed():
    run_distributed(_rank_and_sum, 2)
    pids = live_pool_pids(2)
    with pytest.raises(DistributedTestError, match=r"ranks \[1\] did not finish within 3s"):
        run_distributed(_hang_on_rank_one, 2, timeout=3)
    assert not any(_alive(p) for p in pids)
