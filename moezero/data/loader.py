"""Micro-batches read ahead of their step by worker processes (Megatron's --num-workers).

    loader = MicroBatchLoader(dataset, index_lists, num_workers=2)
    for batch in loader: ...       # collated dicts, in the order of `index_lists`
    loader.close()

The order, and so every number of a run, does not depend on `num_workers`: workers only read.
"""

from __future__ import annotations

import signal
from typing import Dict, Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader

from moezero.data.errors import DataError
from moezero.data.sampler import load_micro_batch


class _MicroBatchReader(torch.utils.data.Dataset):
    """dataset[list of global indices] -> one collated micro-batch (the DataLoader runs it in a worker)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, indices: Sequence[int]) -> Dict[str, torch.Tensor]:
        return load_micro_batch(self.dataset, indices)


def _leave_stop_signals_to_the_rank(worker_id: int) -> None:
    """A scheduler's SIGTERM (scancel) or a terminal's Ctrl-C reaches the whole process tree: a worker that died
    of it would fail the rank's next read before the rank could save. The rank decides (--exit-signal-handler, or
    the default disposition); the workers end with it (torch's DataLoader watches its parent)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):  # USR1/2: --exit-signal's
        signal.signal(sig, signal.SIG_IGN)


class MicroBatchLoader:
    def __init__(self, dataset, index_lists: Iterable[Sequence[int]], num_workers: int):
        if num_workers == 0:
            self._loader = None
            self._batches: Iterator = (load_micro_batch(dataset, indices) for indices in index_lists)
        else:  # batch_size=None: each sampler item (an index list) is one dataset read
            self._loader = DataLoader(
                _MicroBatchReader(dataset),
                sampler=index_lists,
                batch_size=None,
                num_workers=num_workers,
                worker_init_fn=_leave_stop_signals_to_the_rank,
            )
            self._batches = iter(self._loader)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        return self._batches

    def __next__(self) -> Dict[str, torch.Tensor]:
        try:
            return next(self._batches)
        except DataError as exc:  # from a worker, torch adds the worker's traceback: keep the one line
            raise DataError(str(exc).strip().splitlines()[-1].split("DataError: ", 1)[-1]) from None

    def close(self) -> None:
        """Stop the workers now (a run that stops early leaves batches read ahead)."""
        shutdown = getattr(self._batches, "_shutdown_workers", None)  # torch's multi-process iterator
        if shutdown is not None:
            shutdown()
        self._batches = iter(())
