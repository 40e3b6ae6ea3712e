"""Megatron's indexed dataset files (`<prefix>.bin` + `<prefix>.idx`), checked, read and written.

Reading and writing go through megatron-core's `IndexedDataset` / `IndexedDatasetBuilder`
(memory-mapped, the format Megatron-LM's tools produce). Before megatron-core sees a prefix,
`check_indexed_dataset` reads the small `.idx` header itself and compares every size with the
files on disk, so a missing, foreign, truncated or mismatched file is one clear `DataError`
instead of an assertion or a read past the end deep inside a training step.

.idx layout (version 1): b"MMIDIDX\\0\\0", u64 version, u8 dtype code, u64 sequence count n,
u64 document count d, then int32[n] sequence lengths, int64[n] byte offsets, int64[d]
document boundaries (sequence indices, first 0, last n).
"""

from __future__ import annotations

import os
import re
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from moezero.data._megatron import megatron_datasets
from moezero.data.errors import DataError
from moezero.data.tokenizer_record import remove_record, write_record
from moezero.leftovers import remove_leftovers

_HEADER = b"MMIDIDX\x00\x00"
_FIXED_BYTES = len(_HEADER) + 8 + 1 + 8 + 8
_TOKEN_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


@dataclass(frozen=True)
class IndexSummary:
    """What a valid `.idx` file describes."""

    dtype: type
    num_sequences: int
    num_documents: int
    num_tokens: int


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> IndexSummary:
    """Validate `<prefix>.idx` and `<prefix>.bin` against each other; raise `DataError` if unusable."""
    return _read_index(prefix, flag)[0]


def read_sequence_lengths(prefix: str, flag: str = "--data-path") -> np.ndarray:
    """The token count of every sequence (document) of a prefix, after the same checks."""
    return _read_index(prefix, flag)[1]


def _read_index(prefix: str, flag: str):
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(
                f"{flag}: {path} does not exist (a dataset prefix needs {prefix}.bin and "
                f"{prefix}.idx, written by tools/preprocess_data.py)"
            )
    idx_size = os.path.getsize(idx_path)

    def corrupt(why: str) -> DataError:
        return DataError(
            f"{flag}: {idx_path} is not a valid Megatron index ({why}); re-create it with tools/preprocess_data.py"
        )

    with open(idx_path, "rb") as f:
        head = f.read(_FIXED_BYTES)
    if len(head) < _FIXED_BYTES or head[: len(_HEADER)] != _HEADER:
        raise corrupt("bad header" if len(head) >= len(_HEADER) else f"only {idx_size} bytes")
    version, code, n, d = struct.unpack("<QBQQ", head[len(_HEADER) :])
    if version != 1:
        raise corrupt(f"version {version}, expected 1")
    if code not in _TOKEN_DTYPES:
        raise corrupt(f"token dtype code {code} is not an integer type")
    expected = _FIXED_BYTES + 4 * n + 8 * n + 8 * d
    if idx_size != expected:
        raise corrupt(f"{idx_size} bytes where its header promises {expected}: truncated or multimodal")
    lengths = np.fromfile(idx_path, dtype=np.int32, count=n, offset=_FIXED_BYTES)
    docs = np.fromfile(idx_path, dtype=np.int64, count=d, offset=_FIXED_BYTES + 12 * n)
    if d < 1 or docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0) or np.any(lengths < 0):
        raise corrupt("inconsistent document boundaries or sequence lengths")
    dtype = _TOKEN_DTYPES[code]
    num_tokens = int(lengths.sum(dtype=np.int64))
    bin_size = os.path.getsize(bin_path)
    if bin_size != num_tokens * np.dtype(dtype).itemsize:
        raise DataError(
            f"{flag}: {bin_path} has {bin_size} bytes but {idx_path} describes {num_tokens} "
            f"{np.dtype(dtype).name} tokens ({num_tokens * np.dtype(dtype).itemsize} bytes): "
            "truncated, or .bin and .idx are from different runs"
        )
    summary = IndexSummary(dtype=dtype, num_sequences=int(n), num_documents=int(d - 1), num_tokens=num_tokens)
    return summary, lengths


def open_indexed_dataset(prefix: str, flag: str = "--data-path"):
    """A checked, memory-mapped megatron-core `IndexedDataset` for `prefix`."""
    check_indexed_dataset(prefix, flag)
    return megatron_datasets().IndexedDataset(prefix, multimodal=False, mmap=True)


def token_dtype(vocab_size: int) -> type:
    """The narrowest dtype megatron-core stores a vocabulary of this size in (uint16 or int32)."""
    return megatron_datasets().DType.optimal_dtype(vocab_size)


def write_indexed_dataset(prefix: str, documents: Iterable, vocab_size: int, tokenizer=None) -> IndexSummary:
    """Write `documents` (1-D integer arrays, one per document) as `<prefix>.bin/.idx`, and with `tokenizer` the
    record of it beside them (tokenizer_record). See `stage_indexed_dataset`."""
    return stage_indexed_dataset(prefix, documents, vocab_size).publish(tokenizer)


def stage_indexed_dataset(prefix: str, documents: Iterable, vocab_size: int) -> "StagedDataset":
    """Write `documents` under temporary names beside `prefix`; the result's publish() renames them into place.

    Empty documents are skipped. A write that fails removes its files; the temporary files a killed write left
    on this host are removed by the next write of the same prefix.
    """
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    _remove_killed_writes(prefix)
    tmp = f"{prefix}.tmp-{socket.gethostname()}-{os.getpid()}"
    builder = megatron_datasets().IndexedDatasetBuilder(tmp + ".bin", dtype=token_dtype(vocab_size))
    staged = StagedDataset(prefix, tmp)
    try:
        for doc in documents:
            doc = np.asarray(doc)
            if doc.size:
                builder.add_document(doc, [doc.size])
        builder.finalize(tmp + ".idx")
        staged.summary = check_indexed_dataset(tmp, flag="output")
    except BaseException:
        builder.data_file.close()
        staged.discard()
        raise
    return staged


class StagedDataset:
    """A dataset written under temporary names (`tmp`.bin/.idx), not yet at `prefix`."""

    def __init__(self, prefix: str, tmp: str):
        self.prefix, self.tmp = prefix, tmp
        self.summary: Optional[IndexSummary] = None

    def publish(self, tokenizer=None) -> IndexSummary:
        """Rename the files into place (.bin first, .idx last: a reader never sees a half-written pair, a crash
        leaves the old files or a mismatch `check_indexed_dataset` reports), then write the tokenizer record."""
        remove_record(self.prefix)
        os.replace(self.tmp + ".bin", self.prefix + ".bin")
        os.replace(self.tmp + ".idx", self.prefix + ".idx")
        if tokenizer is not None:
            write_record(self.prefix, tokenizer)
        return self.summary

    def discard(self) -> None:
        for path in (self.tmp + ".bin", self.tmp + ".idx"):
            if os.path.exists(path):
                os.remove(path)


def _remove_killed_writes(prefix: str) -> None:
    """The temporary files of earlier writes of `prefix` whose process, on this host, is gone (killed: no
    cleanup ran); those of another host, or of a process still running, are left."""
    folder, name = os.path.split(os.path.abspath(prefix))
    pattern = re.compile(re.escape(f"{name}.tmp-{socket.gethostname()}-") + r"(\d+)\.(bin|idx)$")
    killed = [
        entry
        for entry in sorted(os.listdir(folder))
        if (match := pattern.match(entry)) and not _process_alive(int(match.group(1)))
    ]
    remove_leftovers(folder, killed, prefix, "left by a write of it that was killed")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
