"""The real scripts as subprocesses: the pretraining script (alone or under torchrun) and the tools.

Every run has a timeout and runs in its own session, so a test that fails half-way still kills the
whole process tree (torchrun and its workers)."""

import contextlib
import functools
import importlib.util
import io
import os
import signal
import subprocess
import sys
import warnings
from typing import Iterator, List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "examples_moe", "pretrain_gpt_moe.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def tool(name: str) -> str:
    return os.path.join(REPO, "tools", f"{name}.py")


def torchrun(nproc: int, script: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]


def run(cmd: List[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run to the end (killed with its children after `timeout`); stdout and stderr captured apart."""
    with started(cmd, stderr=subprocess.PIPE) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@contextlib.contextmanager
def started(cmd: List[str], stderr=subprocess.STDOUT) -> Iterator[subprocess.Popen]:
    """A running process (text stdout pipe); on exit from the block its session is killed if still alive."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=ENV,
        cwd=REPO,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _default_sigint() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt:
    the scripts under test get the default disposition, as from a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def script_in_process(argv: List[str], capsys) -> subprocess.CompletedProcess:
    """The pretraining script's entry point (moezero.recipe.main, all the script calls) in this process, for the
    runs that end before training (bad flags, a refused resume): the exit code and output of a run, without a Python
    start each. `capsys` is pytest's fixture; what it held before is dropped."""
    from moezero.recipe import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's exit(2), as in the script
        code = stop.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["pretrain_gpt_moe.py"] + argv, code, captured.out, captured.err)


def tool_in_process(name: str, argv: List[str]) -> subprocess.CompletedProcess:
    """tools/<name>.py's main(argv) in this process: the exit code, stdout and stderr (its warnings written there as
    Python prints them), without a Python start and a torch import each. The command lines themselves run for real in
    the docs' tests and in the tests of a tool's refusals that run it as a script."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = functools.partial(_print_warning, err)  # where they come, as Python prints them
        try:
            code = _tool_module(name).main(argv)
        except SystemExit as stop:  # argparse's exit(2), as in the script
            code = stop.code
    return subprocess.CompletedProcess([tool(name)] + argv, code or 0, out.getvalue(), err.getvalue())


def _print_warning(stream, message, category, filename, lineno, file=None, line=None) -> None:
    stream.write(warnings.formatwarning(message, category, filename, lineno, line))


@functools.lru_cache(maxsize=None)
def _tool_module(name: str):
    spec = importlib.util.spec_from_file_location(f"moezero_tool_{name}", tool(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
