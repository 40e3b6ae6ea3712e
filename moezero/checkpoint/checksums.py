"""What a checkpoint must contain, recorded when it is written and verified before it is read.

Each rank's DCP writer hashes every byte it writes to its shard files as it writes them (xxh3-64, the
`xxhash` package: no extra read pass, and fast enough that a save costs little more, where zlib's crc32
would not be; tools/bench_checkpoint_checksums.py measures it); rank 0 gathers the digests and writes
`checksums.json` into the staging folder before it is renamed into place:

    {"format": ..., "iteration": N, "world_size": W, "algorithm": "xxh3_64",
     "files": {"__0_0.distcp": {"bytes": n, "digest": hex}, ..., ".metadata": {...}}}

A load reads the manifest, checks the iteration against the folder's name and every listed file's length, and
hashes the files it is about to read (all of them offline): a shard of another iteration or flipped bytes are
one `CheckpointError` naming the file. The checkpoint stays a plain DCP checkpoint (no stream transform is
recorded in its metadata), so torch's own tools still read it. Checkpoints written before this have no
manifest and load unverified.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
from typing import Dict, Iterable, Optional

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms

from moezero.checkpoint.errors import CheckpointError

MANIFEST = "checksums.json"
FORMAT = "moezero-checksums-v1"
_CHUNK = 8 << 20
_ITER = re.compile(r"iter_(\d+)(\.tmp)?$")


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter, hashing each shard file as its bytes are written (one hasher per file)."""

    def __init__(self, path: str, **kwargs):
        super().__init__(path, **kwargs)
        self.transforms = _HashingTransforms()

    def digests(self) -> Dict[str, Dict[str, object]]:
        """{file name: {"bytes", "digest"}} of the shard files this writer wrote."""
        return self.transforms.digests()


class _HashingTransforms(_StorageWriterTransforms):
    def __init__(self):
        super().__init__(())
        self._hashers: Dict[str, "_FileHash"] = {}
        self._lock = threading.Lock()  # DCP may write several files at once, one thread each

    def transform_save_stream(self, write_item, raw_stream):
        stream, descriptors = super().transform_save_stream(write_item, raw_stream)
        name = os.path.basename(getattr(raw_stream, "name", ""))
        if not name:
            raise CheckpointError("checkpoint checksums need DCP to write to named files")
        with self._lock:
            file_hash = self._hashers.setdefault(name, _FileHash())
        return _HashingStream(stream, file_hash), descriptors

    def digests(self) -> Dict[str, Dict[str, object]]:
        return {name: h.record() for name, h in self._hashers.items()}


class _FileHash:
    def __init__(self):
        self.hasher, self.bytes = xxhash.xxh3_64(), 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self.bytes += view.nbytes

    def record(self) -> Dict[str, object]:
        return {"bytes": self.bytes, "digest": self.hasher.hexdigest()}


class _HashingStream(io.IOBase):
    """Passes every write through to DCP's stream, hashing it on the way."""

    def __init__(self, target, file_hash: _FileHash):
        self.target, self.file_hash = target, file_hash

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.file_hash.update(data)
        return self.target.write(data)

    def close(self) -> None:
        self.target.close()
        super().close()


def file_record(path: str) -> Dict[str, object]:
    """{"bytes", "digest"} of a file, read in chunks."""
    hasher, size = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            hasher.update(chunk)
            size += len(chunk)
    return {"bytes": size, "digest": hasher.hexdigest()}


def write_manifest(folder: str, iteration: int, world_size: int, shard_digests: Iterable[Dict]) -> None:
    """Rank 0, before the folder is published: every rank's shard digests and the index's."""
    files: Dict[str, Dict[str, object]] = {}
    for digests in shard_digests:
        files.update(digests)
    files[".metadata"] = file_record(os.path.join(folder, ".metadata"))
    manifest = {
        "format": FORMAT,
        "iteration": iteration,
        "world_size": world_size,
        "algorithm": "xxh3_64",
        "files": dict(sorted(files.items())),
    }
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str) -> Optional[Dict]:
    """The checkpoint's manifest (None: written before checksums), its iteration checked against the folder's."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        return None
    try:
        with open(file) as f:
            manifest = json.load(f)
        files, iteration = manifest["files"], int(manifest["iteration"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{file}: unreadable ({str(exc)[:80]}); the checkpoint cannot be verified, resume "
            "from another one with --ckpt-step N"
        ) from None
    named = _ITER.search(os.path.basename(os.path.normpath(path)))
    if named and int(named.group(1)) != iteration:
        raise CheckpointError(
            f"{file}: records iteration {iteration}, but the folder is iteration "
            f"{int(named.group(1))}; resume from another checkpoint with --ckpt-step N"
        )
    if not isinstance(files, dict):
        raise CheckpointError(f"{file}: unreadable (no file list)")
    return manifest


def verify_files(path: str, manifest: Dict, names: Iterable[str]) -> Optional[str]:
    """The first of `names` whose length or digest differs from the manifest, as one line (None: all match)."""
    for name in sorted(set(names)):
        expected = manifest["files"].get(name)
        file = os.path.join(path, name)
        if expected is None:
            return f"{file}: not in the checkpoint's {MANIFEST} (a file of another checkpoint?)"
        if not os.path.isfile(file):
            return f"{file}: is missing"
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            return f"{file}: holds {size:,} bytes, the checkpoint wrote {expected['bytes']:,}"
        if file_record(file)["digest"] != expected["digest"]:
            return (
                f"{file}: its contents differ from what the checkpoint wrote (checksum mismatch: damaged, or "
                "replaced by another checkpoint's file)"
            )
    return None
