"""Quiet, lazy access to megatron-core's dataset modules.

Importing anything under `megatron.core` runs its package `__init__`, which imports its models,
optimizers and FSDP (several seconds) and warns that Transformer Engine and Apex are missing.
None of that concerns the data layer, so the import happens only when data is first built, with
the warnings raised during that import and its INFO log lines silenced; its dataset loggers are held at WARNING
(the blended-dataset one at ERROR: its warnings are about choices this package makes on purpose).
"""
from __future__ import annotations

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
