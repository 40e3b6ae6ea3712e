"""Quiet, lazy access to megatron-core's dataset modules.

Importing anything under `megatron.core` runs its package `__init__`, which imports its models, optimizers,
FSDP and torch.compile'd fusions (2.8 s of every training process's start, 0.75 s without it) and warns that
Transformer Engine and Apex are missing. None of that concerns the data layer, so the dataset modules are
imported with the package's `__init__` deferred: submodules still import as usual, and the first other
attribute asked of `megatron.core` itself (`megatron.core.__version__`, `from megatron.core import mpu`) runs
it, so other users of megatron-core in the process see the whole package. One side effect waits for it:
megatron-core's `register_safe_globals()` (the classes `torch.load(weights_only=True)` accepts in a Megatron
checkpoint); a process that loads one after building data calls it, or imports `megatron.core` before.

The import happens only when data is first built, with the warnings raised during it and its INFO log lines
silenced; its dataset loggers are held at WARNING (the blended-dataset one at ERROR: its warnings are about
choices this package makes on purpose). Its cached-index readers get a numpy that refuses pickles (index_cache).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import threading
import types
import warnings

from moezero.data.errors import DataError
from moezero.data.index_cache import INDEX_READERS, refuse_pickled_indices

_QUIET_LOGGERS = {
    "megatron.core.datasets": logging.WARNING,
    "megatron.core.datasets.blended_dataset": logging.ERROR,
    "megatron.core.distributed.fsdp": logging.WARNING,
}


def megatron_datasets() -> types.SimpleNamespace:
    """megatron-core's dataset classes, imported once (sys.modules caches them) and quietly."""
    for name, level in _QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    first = "megatron.core" not in sys.modules
    with warnings.catch_warnings():
        if first:  # whatever warns while megatron.core imports its unrelated parts (TE/Apex, torch.jit)
            warnings.simplefilter("ignore")
        try:
            if first:
                _defer_package_init("megatron.core")
                importlib.import_module("megatron.core.parallel_state")  # before utils: the two import each other
            from megatron.core.datasets import helpers
            from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
            from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
        except ImportError as exc:
            raise DataError(
                "the data layer needs megatron-core with its compiled dataset helpers "
                f"(pip install 'megatron-core>=0.16.1,<0.18'): {exc}"
            ) from exc
    refuse_pickled_indices(sys.modules[name] for name in INDEX_READERS)
    return types.SimpleNamespace(
        BlendedMegatronDatasetBuilder=BlendedMegatronDatasetBuilder,
        GPTDataset=GPTDataset,
        MockGPTDataset=MockGPTDataset,
        GPTDatasetConfig=GPTDatasetConfig,
        IndexedDataset=IndexedDataset,
        IndexedDatasetBuilder=IndexedDatasetBuilder,
        DType=DType,
        helpers=helpers,
    )


def _defer_package_init(name: str) -> None:
    """Put package `name` in sys.modules without running its `__init__`: its submodules import as usual (also
    as `from name import submodule`), and the first other attribute missing from the package (anything its
    `__init__` defines) runs the `__init__` in place."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"No module named {name!r}")
    package = importlib.util.module_from_spec(spec)
    package.__getattr__ = _DeferredInit(package)
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)  # as the import system binds a loaded submodule


class _DeferredInit:
    """The `__getattr__` of a package whose `__init__` has not run: a submodule's name imports the submodule, any
    other name runs the `__init__` once. Other threads wait for it, as an import's module lock makes them; one that
    fails leaves the package to try again, and one that succeeds leaves a plain package."""

    def __init__(self, package):
        self.package = package
        self.lock = threading.RLock()
        self.running = False  # the __init__'s own reads of names it has not defined yet fail, as in an import

    def __call__(self, attribute: str):
        name = self.package.__name__
        if "." not in attribute and importlib.util.find_spec(f"{name}.{attribute}") is not None:
            return importlib.import_module(f"{name}.{attribute}")
        with self.lock:
            if not self.running and vars(self.package).get("__getattr__") is self:
                self.running = True
                try:
                    self.package.__spec__.loader.exec_module(self.package)
                    if vars(self.package).get("__getattr__") is self:
                        del self.package.__getattr__
                finally:
                    self.running = False
        try:
            return vars(self.package)[attribute]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}") from None
