"""When a run stops before --train-iters: a signal (--exit-signal-handler: --exit-signal, SIGTERM by default, or
SIGINT), the wall clock
(--exit-duration-in-mins) or --exit-interval. The run then saves (with --save) and exits 0.

A scheduler's SIGTERM may reach some ranks only, and clocks differ, so with either of the first two
on, the ranks agree after every iteration with one small all-reduce (MAX) over the world: all stop
after the same iteration. The handler only records the signal; the iteration in flight finishes.
A second Ctrl-C (SIGINT) gets the default behaviour back: it interrupts at once. A second SIGTERM is only
recorded again, as Megatron's handler does: Slurm signals every process of a job step, so each rank gets the
scheduler's SIGTERM and torchrun's forwarded one, and must still save.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Dict, Optional

import torch

from moezero.parallel import comm

# --exit-duration-in-mins counts from the script's start (this module is imported with the training code, before
# the data and the checkpoint load), as Megatron counts from its start: a limit sized to a job's wall time
PROCESS_START = time.monotonic()


class StopConditions:
    """Installs the handlers (with --exit-signal-handler) until `close()`; `reason()` after each iteration."""

    def __init__(self, train_config, group: Optional[Any]):
        self.cfg = train_config
        self.group = group
        self.start = PROCESS_START
        self.received: Optional[int] = None
        self._previous: Dict[int, Any] = {}
        if train_config.exit_signal_handler:
            for sig in {signal.Signals[train_config.exit_signal], signal.SIGINT}:  # --exit-signal, and Ctrl-C
                self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        if self.received == signum == signal.SIGINT:  # Ctrl-C twice: stop now, the default way
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.received = signum

    def reason(self, iteration: int) -> Optional[str]:
        """Why to stop after `iteration` (the same on every rank), or None to go on."""
        if self.cfg.exit_signal_handler or self.cfg.exit_duration_in_mins is not None:
            minutes = (time.monotonic() - self.start) / 60.0
            local = torch.tensor([self.received or 0, minutes], dtype=torch.float64, device=self._device())
            comm.all_reduce(local, self.group, op=torch.distributed.ReduceOp.MAX)
            received, minutes = int(local[0].item()), local[1].item()
            if iteration >= self.cfg.train_iters:  # the run is done: it saves and finishes as any run does
                return None
            if received:
                return f"received {signal.Signals(received).name}"
            if self.cfg.exit_duration_in_mins is not None and minutes >= self.cfg.exit_duration_in_mins:
                return f"--exit-duration-in-mins={self.cfg.exit_duration_in_mins:g} reached ({minutes:.1f} min)"
        if self.cfg.exit_interval and iteration % self.cfg.exit_interval == 0 and iteration < self.cfg.train_iters:
            return f"--exit-interval={self.cfg.exit_interval}"
        return None

    def _device(self) -> torch.device:
        nccl = torch.distributed.is_initialized() and torch.distributed.get_backend(self.group) == "nccl"
        return torch.device("cuda") if nccl else torch.device("cpu")

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
