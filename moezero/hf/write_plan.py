"""Which rank writes which Hub tensor into which file, decided alike on every rank with no communication.

Each moezero tensor goes whole to one writer (a routed-expert stack: each ep rank's experts to one member of the
ranks holding them), the least loaded so far of the ranks that hold it; a rank's tensors then fill its own files
of at most `max_shard_bytes`, numbered rank after rank. So every rank writes about 1/world of the model and
never holds more than its share (plus the unit an export is reading).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class Piece:
    """A moezero tensor's Hub tensors as one writer's work: `name` (the moezero tensor, with the first
    global expert of a stack's block), the ranks that hold its values, and its Hub keys with their bytes."""

    name: str
    holders: Tuple[int, ...]
    keys: Tuple[Tuple[str, int], ...]  # (Hub key, bytes)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.keys)


@dataclass(frozen=True)
class WritePlan:
    writer: Dict[str, int]  # piece name -> its rank
    file_of: Dict[str, str]  # Hub key -> file name
    files_of_rank: Dict[int, List[List[str]]]  # rank -> its files' keys, in file order
    names: List[str]  # every file name, in order

    def files(self, rank: int) -> List[Tuple[str, List[str]]]:
        """(file name, its keys) of the files `rank` writes."""
        return [(self.file_of[keys[0]], keys) for keys in self.files_of_rank.get(rank, [])]


def plan_writes(pieces: Sequence[Piece], world_size: int, max_shard_bytes: int) -> WritePlan:
    load = [0] * world_size
    writer: Dict[str, int] = {}
    keys_of_rank: Dict[int, List[Tuple[str, int]]] = {}
    for piece in pieces:
        rank = min(piece.holders, key=lambda r: (load[r], r))
        writer[piece.name] = rank
        load[rank] += piece.nbytes
        keys_of_rank.setdefault(rank, []).extend(piece.keys)
    files_of_rank = {rank: _fill(keys, max_shard_bytes) for rank, keys in sorted(keys_of_rank.items())}
    count = sum(len(files) for files in files_of_rank.values())
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    file_of, position = {}, 0
    for rank, files in files_of_rank.items():
        for keys in files:
            file_of.update({key: names[position] for key in keys})
            position += 1
    return WritePlan(writer, file_of, files_of_rank, names)


def _fill(keys: Sequence[Tuple[str, int]], max_shard_bytes: int) -> List[List[str]]:
    """Keys in order into files of at most `max_shard_bytes` (a larger tensor gets a file of its own)."""
    files: List[List[str]] = [[]]
    size = 0
    for key, nbytes in keys:
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(key)
        size += nbytes
    return files
