"""The dataset index cache (--data-cache-path) read as plain arrays only, never as pickles.

megatron-core's GPT and blended datasets save their document, sample and shuffle indices as .npy files and load
them with `numpy.load(..., allow_pickle=True)`: a file planted under one of those names in a cache folder others
can write to would run its code in every training process. The cache holds integer arrays only, so here every
`numpy.load` of those two megatron-core modules refuses pickled data, and a file that holds some is one
DataError naming it (it is never unpickled, so nothing in it runs).
"""

from __future__ import annotations

import types

import numpy

from moezero.data.errors import DataError

# the megatron-core modules that load cached indices (by the module-level name `numpy`)
INDEX_READERS = ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset")


def load_index(file, mmap_mode=None, allow_pickle=False, **kwargs):
    """numpy.load of a cached index with pickles refused whatever the caller asks: a DataError naming the file."""
    del allow_pickle  # megatron-core passes True; a cached index never needs it
    try:
        return numpy.load(file, mmap_mode=mmap_mode, allow_pickle=False, **kwargs)
    except ValueError as error:
        if not holds_python_objects(file):
            raise
        raise DataError(
            f"--data-cache-path: the dataset index file {file} holds pickled Python objects, not an "
            "index array; it is not loaded (unpickling runs code from the file): delete it (it is "
            "rebuilt) and keep the cache folder writable by you only"
        ) from error


def holds_python_objects(file) -> bool:
    """Whether a .npy file holds pickled data (an object array, or a pickle saved under the name)."""
    try:
        with open(file, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                return True  # numpy.load reads anything but a .npy or .npz as a pickle
            f.seek(0)
            version = numpy.lib.format.read_magic(f)
            header = (
                numpy.lib.format.read_array_header_1_0 if version == (1, 0) else numpy.lib.format.read_array_header_2_0
            )(f)
        return header[2].hasobject
    except (OSError, ValueError):
        return False


class _NumpyWithoutPickles(types.ModuleType):
    """numpy, but for `load`: what megatron-core's index readers see as their `numpy`."""

    def __init__(self):
        super().__init__("numpy")
        self.load = load_index

    def __getattr__(self, name):
        return getattr(numpy, name)


def refuse_pickled_indices(modules) -> None:
    """Point the index readers' `numpy` at one whose `load` refuses pickles (idempotent)."""
    for module in modules:
        if not isinstance(module.numpy, _NumpyWithoutPickles):
            module.numpy = _NumpyWithoutPickles()
