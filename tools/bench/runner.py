"""Launch benchmark workers under torchrun (moezero's venv or DeepSpeed's) and collect their RESULT lines."""

import json
import os
import re
import subprocess
import sys
import threading
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PEER_DIR = os.environ.get("PEER_DIR", os.path.expanduser("~/.cache/moezero-peers/deepspeed"))
DEEPSPEED_VERSION = "0.19.8"
_port = [29700]
_port_lock = threading.Lock()  # side-by-side runs start workers from several threads


def deepspeed_python(install: bool = True) -> Optional[str]:
    """DeepSpeed's venv python (the recipe of ../shared/peers/deepspeed), created when missing and allowed."""
    python = os.path.join(PEER_DIR, "venv", "bin", "python")
    if _imports(python, "deepspeed"):
        return python
    if not install:
        return None
    print(
        f"creating DeepSpeed {DEEPSPEED_VERSION} venv in {PEER_DIR}/venv (CPU torch 2.13.0, DS_BUILD_OPS=0)",
        file=sys.stderr,
    )
    env = dict(os.environ, DS_BUILD_OPS="0")
    subprocess.run([sys.executable, "-m", "venv", os.path.join(PEER_DIR, "venv")], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0", "numpy", "einops", "psutil"], check=True, env=env)
    subprocess.run(pip + [f"deepspeed=={DEEPSPEED_VERSION}"], check=True, env=env)
    return python if _imports(python, "deepspeed") else None


def _imports(python: str, module: str) -> bool:
    if not os.path.exists(python):
        return False
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def run_worker(
    system: str,
    worker_args: List[str],
    nproc: int = 2,
    timeout: int = 1800,
    python: Optional[str] = None,
    env_extra: Optional[Dict[str, str]] = None,
    script: Optional[str] = None,
) -> Dict:
    """Run one configuration; returns the worker's RESULT dict, or {"error": ...}. `script`: a worker of its own
    (a path under tools/bench), given `worker_args` only."""
    with _port_lock:
        _port[0] += 1
        port = _port[0]
    deepspeed = system == "deepspeed"
    own_script = script is not None
    script = os.path.join(HERE, script or ("deepspeed_worker.py" if deepspeed else "gpt_worker.py"))
    python = python or (deepspeed_python() if deepspeed else sys.executable)
    if python is None:
        return {"error": "DeepSpeed is not installed"}
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        DS_ACCELERATOR="cpu",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **(env_extra or {}),
    )
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--master_port={port}",
        script,
    ] + worker_args
    if not deepspeed and not own_script:
        cmd += ["--system", system]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": _exception_line(proc.stdout + proc.stderr) or f"exit code {proc.returncode}"}


def run_side_by_side(system: str, worker_args: List[str], copies: int = 2, **kwargs) -> Dict:
    """`copies` one-process runs of the same configuration started at once (each its own world of one, sharing
    the host's cores, caches and memory as the ranks of one run do): the first one's RESULT with `step_s` the
    mean of theirs and each per-rank list holding every copy's value."""
    results: List[Dict] = [{}] * copies

    def run(k: int) -> None:
        results[k] = run_worker(system, worker_args, nproc=1, **kwargs)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(copies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    merged = dict(
        results[0],
        step_s=sum(r["step_s"] for r in results) / copies,
        tokens_per_s=sum(r["tokens_per_s"] for r in results),
        side_by_side=copies,
    )
    for key, value in results[0].items():
        if key.endswith("_per_rank") and isinstance(value, list):
            merged[key] = [v for r in results for v in r[key]]
    return merged


_EXCEPTION = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception)\b: .*)")


def _exception_line(output: str) -> str:
    """The first worker exception ("RuntimeError: ..."), not torchrun's summary of the failure."""
    for line in output.splitlines():
        found = _EXCEPTION.match(line)
        if found and "ChildFailedError" not in found.group(1):
            return found.group(1)[:300]
    return ""
