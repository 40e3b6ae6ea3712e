"""What the project launches (make train, examples_moe/*.sh) listens on loopback only: torchrun's stores listen on
every interface under --standalone (torch's code, no flag binds them), examples_moe/torchrun_local.py binds them to
127.0.0.1. Checked on the listening sockets of the whole process tree, torchrun's and the workers' (gloo)."""

import os
import sys
import time

import psutil
import pytest

from tests.integration.scripts import REPO, started

WORKER = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"ready{dist.get_rank()}"), "w").close()
time.sleep(60)
"""


def _listening(root_pid):
    """(address, process name) of every TCP socket the process tree of `root_pid` listens on."""
    out = []
    root = psutil.Process(root_pid)
    for proc in [root] + root.children(recursive=True):
        try:
            out += [
                (c.laddr.ip, proc.name()) for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
            ]
        except psutil.NoSuchProcess:
            continue
    return out


@pytest.mark.parametrize("launcher", ["torchrun_local", "torchrun"])
def test_the_projects_launcher_listens_on_loopback_only(launcher, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    entry = (
        [os.path.join(REPO, "examples_moe", "torchrun_local.py")]
        if launcher == "torchrun_local"
        else ["-m", "torch.distributed.run"]
    )
    with started([sys.executable] + entry + ["--standalone", "--nproc_per_node=2", str(worker), str(tmp_path)]) as proc:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        listening = _listening(proc.pid)
    assert any(name == "pt_elastic" for _, name in listening), listening  # torchrun's stores are there
    outside = [(ip, name) for ip, name in listening if ip not in ("127.0.0.1", "::1")]
    if launcher == "torchrun_local":
        assert not outside, listening
    else:  # torch's own: every interface ('::' or 0.0.0.0); if this changes, torchrun_local may go
        assert outside, listening


def test_torchrun_local_is_for_one_machine(capsys):
    sys.path.insert(0, os.path.join(REPO, "examples_moe"))
    try:
        from torchrun_local import main
    finally:
        sys.path.pop(0)
    assert main(["--nnodes=2", "--nproc_per_node=2", "x.py"]) == 2
    assert "give --standalone" in capsys.readouterr().err
