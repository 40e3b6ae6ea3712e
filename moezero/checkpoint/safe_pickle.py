"""The pickles a checkpoint holds, read without running code from the file.

A DCP checkpoint keeps three kinds of pickle: its index (`.metadata`, DCP's dataclasses), the byte entries DCP
saves with `torch.save` (moezero's train state and RNG states, stored as bytes) and, inside those bytes, the
train state and RNG states themselves (`pickle.dumps`). torch reads the first two with the plain unpickler
(`pickle.load`, `torch.load(weights_only=False)`), which runs whatever a crafted file names. Here each is read by
an unpickler that admits only the classes and functions such a file holds:

    read_dcp_metadata(file)       .metadata: DCP's metadata classes, torch.Size, dtypes, layouts, paths
    decode_blob(blob)             train state / RNG states: builtin containers, numpy and torch tensors
    SafeFileSystemReader(path)    DCP's reader, its .metadata read as above
    SafeLoadPlanner(...)          DCP's load planner, its byte entries read with torch.load(weights_only=True)

Anything else is an `UnsafePickle` naming what the file asked for. This keeps a checkpoint from running code;
it is otherwise trusted input (its tensors and configs are used as they are).
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from typing import Any, BinaryIO, Dict, Tuple

import numpy as np
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo


class UnsafePickle(pickle.UnpicklingError):
    """A checkpoint's pickle names a class or function no checkpoint holds (a file crafted to run code?)."""


def _dtypes() -> Dict[Tuple[str, str], Any]:
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def _storage_from_bytes(blob: bytes):
    """torch's `_load_from_bytes` (how plain pickle stores a tensor's storage), without running code."""
    return torch.load(io.BytesIO(blob), weights_only=True)


# builtins: data types only, never a callable that runs or looks up code (eval, getattr, __import__, ...)
_DATA_TYPES = {("builtins", t.__name__): t for t in (set, frozenset, complex, bytearray, slice, range)}

METADATA_GLOBALS: Dict[Tuple[str, str], Any] = {
    **{
        (dcp_metadata.__name__, name): getattr(dcp_metadata, name)
        for name in (
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "StorageMeta",
            "Metadata",
            "MetadataIndex",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **_DATA_TYPES,
    **_dtypes(),
}

BLOB_GLOBALS: Dict[Tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy._core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): np._core.multiarray._reconstruct,
    ("numpy._core.multiarray", "scalar"): np._core.multiarray.scalar,
    ("numpy.core.multiarray", "scalar"): np._core.multiarray.scalar,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("torch", "Size"): torch.Size,
    **_DATA_TYPES,
    **_dtypes(),
}


class _Restricted(pickle.Unpickler):
    """The standard unpickler, resolving only the globals of its table."""

    def __init__(self, file: BinaryIO, allowed: Dict[Tuple[str, str], Any]):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise UnsafePickle(f"it names {module}.{name}, which a checkpoint never holds")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle("it holds a persistent reference, which a checkpoint never holds")


def read_dcp_metadata(file: BinaryIO) -> dcp_metadata.Metadata:
    """A DCP `.metadata` file's index; UnsafePickle where it names anything else, or is not an index."""
    metadata = _Restricted(file, METADATA_GLOBALS).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafePickle(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def decode_blob(blob: Any) -> Any:
    """A train state or RNG state saved with pickle.dumps (anything not bytes is returned as it is)."""
    if not isinstance(blob, (bytes, bytearray)):
        return blob
    return _Restricted(io.BytesIO(blob), BLOB_GLOBALS).load()


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, whose .metadata is read by `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_dcp_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading byte entries with `torch.load(weights_only=True)` (DCP's own: False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
