"""Training data: tokenizers, Megatron indexed datasets (via megatron-core), the default stdlib
corpus, and the layout-invariant batch order.

Importing this package does not import megatron-core; that happens, quietly, on the first
dataset read or write.
"""

from moezero.data.errors import DataError
from moezero.data.gpt_dataset import Blend, GPTDatasets, GPTSamples, build_datasets, parse_data_path
from moezero.data.loader import MicroBatchLoader
from moezero.data.indexed import check_indexed_dataset, open_indexed_dataset, write_indexed_dataset
from moezero.data.sampler import (
    collate,
    eval_micro_batches,
    load_micro_batch,
    micro_batch_indices,
    num_micro_steps,
    train_micro_batches,
)
from moezero.data.tokenizer import ByteLevelTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer, build_tokenizer

__all__ = [
    "DataError",
    "Blend",
    "GPTDatasets",
    "GPTSamples",
    "build_datasets",
    "parse_data_path",
    "check_indexed_dataset",
    "open_indexed_dataset",
    "write_indexed_dataset",
    "collate",
    "eval_micro_batches",
    "load_micro_batch",
    "micro_batch_indices",
    "num_micro_steps",
    "train_micro_batches",
    "MicroBatchLoader",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "build_tokenizer",
]
