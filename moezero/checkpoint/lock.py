"""One job per --save folder: a lock file naming its holder, taken at start and removed at exit.

    lock = lock_save_folder(root)     # collective: rank 0 takes DIR/.moezero-save.lock, every rank learns the
    ...                               # outcome (a CheckpointError on every rank when another job holds it)
    lock.release()                    # at the end of the run, normal or not (idempotent)

Two jobs writing one folder corrupt each other without a word (shards of one in the other's checkpoint, `latest`
on the other's). The lock file holds the holder's host, pid and process start time, and the holder keeps an
exclusive `flock` on it for its life (the kernel drops it when the process dies, however it dies). A second job
stops at start in one line naming the holder. A lock left by a process that is gone (killed: SIGKILL, a signal it
did not handle, a crashed node) is taken over with a line when its holder ran on this host and that pid is not
running, or runs with another start time (the pid was reused). A lock of another host is never taken over
(whether that job lives cannot be known from here): the line says to remove the file once that job has ended.
Where the file system offers no `flock`, the file's contents alone decide.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch.distributed as dist

from moezero.checkpoint.errors import CheckpointError, first_line

LOCK = ".moezero-save.lock"


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux's /proc/<pid>/stat), None where unknown."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the command name, in parentheses, may hold spaces
    return fields[19] if len(fields) > 19 else None


def _boot_id() -> Optional[str]:
    return _read("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough to tell, on its host, whether that process still runs."""

    host: str
    pid: int
    start: Optional[str]  # process_start(pid) when it took the lock
    boot: Optional[str]  # the host's boot id then (a reboot ends every process)
    since: str  # when, for the message

    @classmethod
    def this_process(cls) -> "Holder":
        return cls(
            socket.gethostname(),
            os.getpid(),
            process_start(os.getpid()),
            _boot_id(),
            datetime.datetime.now().isoformat(timespec="seconds"),
        )

    @classmethod
    def parse(cls, text: str) -> Optional["Holder"]:
        try:
            fields = json.loads(text)
            return cls(
                str(fields["host"]),
                int(fields["pid"]),
                fields.get("start"),
                fields.get("boot"),
                str(fields.get("since", "?")),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def text(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, since {self.since}"

    def is_this_process(self) -> bool:
        me = Holder.this_process()
        return (self.host, self.pid, self.start, self.boot) == (me.host, me.pid, me.start, me.boot)

    def gone(self) -> Optional[str]:
        """Why this holder's process no longer runs (None: it runs, or it ran on another host and cannot be
        checked from here)."""
        if self.host != socket.gethostname():
            return None
        if self.boot is not None and _boot_id() not in (None, self.boot):
            return "the host was restarted since"
        if os.path.isdir("/proc/self"):
            start = process_start(self.pid)
            if start is None:
                return f"no process {self.pid} runs"
            if self.start is not None and start != self.start:
                return f"process {self.pid} is another program started later (the pid was reused)"
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return f"no process {self.pid} runs"
        except PermissionError:
            pass
        return None


_HELD: Dict[str, "SaveLock"] = {}  # this process's locks: a second run in one process (tests) reuses its own


class SaveLock:
    """A held lock file (an open descriptor with its flock); `release()` removes it, and the folder too when the lock
    made it and the run left nothing else there (a run refused at start leaves no empty --save folder behind)."""

    def __init__(self, path: str, fd: int, made_folder: bool = False):
        self.path, self.fd, self.made_folder = path, fd, made_folder

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)  # while the flock is still held: no one else has it yet
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
        _HELD.pop(os.path.realpath(self.path), None)
        if self.made_folder:
            try:
                os.rmdir(os.path.dirname(self.path))  # only when empty: never anything this run did not write
            except OSError:
                pass


class _Unlocked:
    def release(self) -> None:
        pass


def _same_file(fd: int, path: str) -> bool:
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _flock(fd: int) -> Optional[bool]:
    """An exclusive flock without waiting: True taken, False another process holds it, None unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP, ...: a file system without flock
        return None


def acquire(root: str, report: Callable[[str], None]) -> SaveLock:
    """One process: take `root`'s lock (creating `root`); a CheckpointError naming the holder when another job
    holds it. `report` gets the line said when a dead holder's lock is taken over."""
    path = os.path.join(root, LOCK)
    held = _HELD.get(os.path.realpath(path))
    if held is not None and held.fd >= 0:
        return held
    try:
        made_folder = not os.path.isdir(root)
        os.makedirs(root, exist_ok=True)
        for _ in range(5):  # the file was removed or replaced between our open and our flock: open it again
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                lock = _take(root, path, fd, report)
            except BaseException:
                os.close(fd)
                raise
            if lock is not None:
                lock.made_folder = made_folder
                _HELD[os.path.realpath(path)] = lock
                return lock
            os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"--save={root}: cannot write there ({first_line(exc)})") from None
    raise CheckpointError(
        f"--save={root}: its lock file {path} keeps changing under this job (another job starting on the same folder?)"
    )


def _take(root: str, path: str, fd: int, report: Callable[[str], None]) -> Optional[SaveLock]:
    locked = _flock(fd)
    if locked and not _same_file(fd, path):
        return None
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    holder = Holder.parse(text) if text else None
    if locked is False or (holder is not None and not holder.is_this_process()):
        _refuse_or_take_over(root, path, holder, report, flocked=locked is False)
    elif text and holder is None:  # not a lock file this code wrote, or one whose writer died mid-write
        if locked is None:
            raise CheckpointError(
                f"--save={root}: its lock file {path} is unreadable and this file system cannot "
                "lock it: remove it if no job uses this folder"
            )
        report(f" --save={root}: took over the unreadable lock file {path} (no process holds it)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, Holder.this_process().text().encode(), 0)
    os.fsync(fd)
    return SaveLock(path, fd)


def _refuse_or_take_over(
    root: str, path: str, holder: Optional[Holder], report: Callable[[str], None], flocked: bool
) -> None:
    """Another process's lock: raise unless its holder is gone (then say so)."""
    who = holder.describe() if holder is not None else "a process that has not written its name yet"
    if flocked or holder is None:
        raise CheckpointError(
            f"--save={root}: in use by another job ({who}; lock file {path}): two jobs on one folder "
            "overwrite each other's checkpoints; save elsewhere, or stop that job first"
        )
    reason = holder.gone()
    if reason is None and holder.host != socket.gethostname():
        raise CheckpointError(
            f"--save={root}: in use by another job ({who}; lock file {path}), which cannot be "
            "checked from this host; save elsewhere, or remove the lock file once that job has "
            "ended"
        )
    if reason is None:
        raise CheckpointError(
            f"--save={root}: in use by another job ({who}; lock file {path}): two jobs on one folder "
            "overwrite each other's checkpoints; save elsewhere, or stop that job first"
        )
    report(f" --save={root}: took over the lock of a job that ended without releasing it ({who}: {reason})")


def _say(line: str) -> None:
    print(line, flush=True)


def lock_save_folder(root: Optional[str], report: Callable[[str], None] = _say):
    """Collective over the world: rank 0 takes `root`'s lock; every rank gets the same outcome (the lock on rank 0,
    a no-op lock elsewhere, or the same CheckpointError on every rank). None `root`: nothing to lock."""
    if root is None:
        return _Unlocked()
    lock, error = _Unlocked(), None
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        try:
            lock = acquire(root, report)
        except CheckpointError as exc:
            error = str(exc)
        except Exception as exc:  # anything else: said on every rank, never a rank left waiting below
            error = f"--save={root}: taking its lock failed ({first_line(exc)})"
    if dist.is_initialized() and dist.get_world_size() > 1:
        outcome = [error]
        dist.broadcast_object_list(outcome, src=0)
        error = outcome[0]
    if error is not None:
        lock.release()
        raise CheckpointError(error)
    return lock
