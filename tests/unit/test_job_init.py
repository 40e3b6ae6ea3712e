"""init_distributed's arguments to torch (moezero/training/job.py), checked without starting a process group."""

import datetime

import pytest
import torch
import torch.distributed as dist

from moezero.training import job


@pytest.fixture
def calls(monkeypatch):
    """What init_process_group / set_device were asked, on a machine that pretends to have GPUs."""
    seen = {"init": [], "set_device": []}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen["init"].append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen["set_device"].append(device))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    return seen


def test_nccl_binds_each_process_to_its_gpu(calls, monkeypatch):
    """Under torchrun with nccl: device_id is the local rank's GPU (NCCL neither guesses it from the global
    rank nor warns on every barrier), the current device is the same one."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    job.init_distributed("nccl", 7)
    ((backend, kw),) = calls["init"]
    assert backend == "nccl" and kw["device_id"] == torch.device("cuda", 1)
    assert kw["timeout"] == datetime.timedelta(minutes=7)
    assert calls["set_device"] == [torch.device("cuda", 1)]


def test_one_gpu_process_joins_a_world_of_one_bound_to_gpu_0(calls):
    job.init_distributed("nccl", 5)
    ((backend, kw),) = calls["init"]
    assert backend == "nccl" and kw["world_size"] == 1 and kw["device_id"] == torch.device("cuda", 0)


def test_gloo_names_no_device(calls, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    job.init_distributed("gloo", 5)
    ((backend, kw),) = calls["init"]
    assert backend == "gloo" and "device_id" not in kw and calls["set_device"] == []
