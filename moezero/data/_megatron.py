"""Quiet, lazy access to megatron-core's dataset modules.

Importing anything under `megatron.core` runs its package `__init__`, which imports its models,
optimizers, FSDP and torch.compile'd fusions (2.8 s of every training process's start, 0.75 s without it) and
warns that Transformer Engine and Apex are missing. None of that concerns the data layer, so the dataset modules
are imported with the package's `__init__` deferred: the first attribute asked of `megatron.core` itself
(`from megatron.core import tensor_parallel`, `megatron.core.__version__`) runs it, so other users of
megatron-core in the process see the whole package. The import happens only when data is first built, with the
warnings raised during it and its INFO log lines silenced; its dataset loggers are held at WARNING (the
blended-dataset one at ERROR: its warnings are about choices this package makes on purpose).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import types
import warnings

from moezero.data.errors import DataError

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
                importlib.import_module("megatron.core.parallel_state")   # before utils: the two import each other
            from megatron.core.datasets import helpers
            from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
            from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
        except ImportError as exc:
            raise DataError(f"the data layer needs megatron-core with its compiled dataset helpers "
                            f"(pip install 'megatron-core>=0.16.1,<0.18'): {exc}") from exc
    return types.SimpleNamespace(
        BlendedMegatronDatasetBuilder=BlendedMegatronDatasetBuilder, GPTDataset=GPTDataset, MockGPTDataset=MockGPTDataset,
        GPTDatasetConfig=GPTDatasetConfig, IndexedDataset=IndexedDataset,
        IndexedDatasetBuilder=IndexedDatasetBuilder, DType=DType, helpers=helpers)


def _defer_package_init(name: str) -> None:
    """Put package `name` in sys.modules without running its `__init__`: its submodules import as usual (also
    as `from name import submodule`), and the first other attribute missing from the package (anything its
    `__init__` defines) runs the `__init__` in place."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"No module named {name!r}")
    package = importlib.util.module_from_spec(spec)

    def run_init(attribute: str):
        if importlib.util.find_spec(f"{name}.{attribute}") is not None:
            return importlib.import_module(f"{name}.{attribute}")
        del package.__getattr__
        spec.loader.exec_module(package)
        return getattr(package, attribute)

    package.__getattr__ = run_init
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)   # as the import system binds a loaded submodule
