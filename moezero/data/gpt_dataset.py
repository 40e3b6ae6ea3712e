"""Train/valid/test GPT samples from indexed datasets, through megatron-core's GPT dataset.

megatron-core does the work: it splits each prefix's documents into train/valid/test by
`--split`, shuffles the documents with a seeded numpy RandomState, cuts the concatenated token
stream (documents end with EOD) into windows of seq_length + 1 tokens, shuffles the windows,
caches those indices as .npy files keyed by an MD5 of its description of them (paths, sizes, split, seed,
tokenizer: not the files' contents, so here the cache folder is also named by the files' sizes and modification
times, and a dataset rewritten at the same prefix gets indices of its own), and blends
weighted prefixes (`--data-path "30 a 70 b"`). With torch.distributed initialised, rank 0
builds the caches while the others wait at a barrier (megatron-core's builder does this).

This module adds what megatron-core leaves to its caller: clear errors for unusable data
(checked before megatron-core runs; data another tokenizer wrote is refused, see tokenizer_record), the
sample dict the training loop uses, and one fix:
megatron-core 0.16 calls `torch.distributed.get_rank()` when caching blend indices, which fails
in a single process without a process group, so there the (cheap) blend indices stay in memory.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from moezero.data._megatron import megatron_datasets
from moezero.data.default_corpus import default_cache_dir, default_corpus_prefix
from moezero.data.errors import DataError
from moezero.data.indexed import read_sequence_lengths
from moezero.data.tokenizer import build_tokenizer
from moezero.data.tokenizer_record import check_record

logger = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their sampling weights (None: in proportion to their sizes)."""

    prefixes: Tuple[str, ...]
    weights: Optional[Tuple[float, ...]] = None


def parse_data_path(data_path: Union[str, Sequence[str]]) -> Blend:
    """Parse `--data-path`: 'p1 p2 ...' or '[w1] p1 [w2] p2 ...' (Megatron's syntax), as a string or words."""
    words = data_path.split() if isinstance(data_path, str) else list(data_path)
    data_path = " ".join(words)
    if not words:
        raise DataError(f"--data-path={data_path!r}: no dataset prefix given")
    weights = [_float_or_none(w) for w in words[0::2]] if len(words) % 2 == 0 else [None]
    if all(w is not None for w in weights):
        if any(w <= 0 for w in weights):  # megatron-core's blend asserts it (with no message)
            raise DataError(f"--data-path={data_path!r}: weights must be > 0 (leave a prefix out to skip it)")
        return Blend(tuple(words[1::2]), tuple(weights))
    if any(w is not None for w in weights) or any(_float_or_none(w) is not None for w in words):
        raise DataError(f"--data-path={data_path!r}: give either prefixes only, or a weight before every prefix")
    return Blend(tuple(words))


def _float_or_none(word: str) -> Optional[float]:
    try:
        return float(word)
    except ValueError:
        return None


class GPTSamples(torch.utils.data.Dataset):
    """One split: `ds[i]` is global sample i as {"tokens", "labels", "loss_mask"}, each shaped [S].

    labels are the tokens shifted left by one (the window holds S + 1 tokens); loss_mask is all
    ones (Megatron's default; EOD tokens are predicted like any other).
    """

    def __init__(self, dataset, split: str):
        self.dataset = dataset
        self.split = split
        self.vocab_limit: Optional[int] = None  # token ids must be below it (the model's vocabulary): checked
        # per sample as read, so a damaged .bin is one line, not an
        # IndexError deep in the embedding

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self.dataset):
            raise IndexError(
                f"{self.split} sample {i} is out of range: the {self.split} set was built with "
                f"{len(self.dataset)} samples (raise num_samples for {self.split})"
            )
        sample = self.dataset[i]
        if self.vocab_limit is not None:
            self._check_token_ids(i, torch.cat([sample["tokens"], sample["labels"][-1:]]))
        return {"tokens": sample["tokens"], "labels": sample["labels"], "loss_mask": sample["loss_mask"]}

    def _check_token_ids(self, i: int, ids: torch.Tensor) -> None:
        low, high = int(ids.min()), int(ids.max())
        if 0 <= low and high < self.vocab_limit:
            return
        prefix, documents = _locate(self.dataset, i)
        raise DataError(
            f"{prefix}.bin: token id {high if high >= self.vocab_limit else low} in document "
            f"{', '.join(map(str, documents))} ({self.split} sample {i}) is outside the model's vocabulary "
            f"(0..{self.vocab_limit - 1}): the file is damaged or was written with another tokenizer"
        )


def _locate(dataset, i: int) -> Tuple[str, List[int]]:
    """(the dataset prefix, the documents) megatron-core's (blended) GPT dataset reads sample i from."""
    if hasattr(dataset, "dataset_index"):  # a blend: which dataset, and which of its samples
        dataset, i = dataset.datasets[int(dataset.dataset_index[i])], int(dataset.dataset_sample_index[i])
    index = int(dataset.shuffle_index[i])
    first, last = int(dataset.sample_index[index][0]), int(dataset.sample_index[index + 1][0])
    documents = sorted({int(d) for d in dataset.document_index[first : last + 1]})
    return getattr(dataset.dataset, "path_prefix", "mock data"), documents


@dataclass
class GPTDatasets:
    """What `build_datasets` returns; a split is None when it has zero weight or was not requested."""

    train: GPTSamples
    valid: Optional[GPTSamples]
    test: Optional[GPTSamples]
    tokenizer: object
    blend: Blend
    notices: Tuple[str, ...] = ()  # lines for the run's log (a split left out)


def build_datasets(
    data_config,
    seq_length: int,
    seed: int,
    num_samples: Sequence[Optional[int]] = (None, None, None),
    rank0_builds_first: bool = True,
) -> GPTDatasets:
    """Build the train/valid/test sample sets of a `DataConfig`.

    Args:
        data_config: `moezero.config.DataConfig` (data path or default corpus, split, tokenizer, cache).
        seq_length: tokens per sample (each window reads seq_length + 1 tokens).
        seed: seeds the document and sample shuffles; the same seed gives the same `ds[i]` on every rank.
        num_samples: samples wanted per split (train, valid, test). None = one epoch; 0 = do not build
            that split. More than one epoch's worth repeats the data in a new order (Megatron's epochs).
        rank0_builds_first: with torch.distributed initialised, rank 0 builds the default corpus before
            the others look for it (they wait at a barrier; call this on every rank). megatron-core's
            index builder synchronises ranks the same way on its own.
    Raises:
        DataError: missing/corrupt files, a bad --split, or a split too small for one sample.
    """
    if seq_length < 1:
        raise DataError(f"--seq-length={seq_length}: must be >= 1")
    tokenizer = build_tokenizer(data_config)
    if data_config.mock_data:
        return _mock_datasets(data_config, tokenizer, seq_length, seed, num_samples)
    if data_config.data_path:
        blend = parse_data_path(data_config.data_path)
    else:
        blend = Blend((default_corpus_prefix(data_config, tokenizer, rank0_builds_first),))
    sizes = _requested_sizes(num_samples, blend)
    lengths = {p: read_sequence_lengths(p) for p in blend.prefixes}  # checks the files before the slow import
    notices: List[str] = []
    for prefix in blend.prefixes:
        check_record(prefix, tokenizer, notices.append)
    mg = megatron_datasets()
    cache = os.path.join(default_cache_dir(data_config.data_cache_path), "indices", _files_fingerprint(blend))
    config = mg.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(list(blend.prefixes), _list(blend.weights)),
        split=data_config.split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=data_config.eod_mask_loss,
        create_attention_mask=False,
    )
    config.split_matrix = _usable_splits(
        config.split_matrix, lengths, sizes, seq_length, data_config.split, notices.append
    )
    builder = _quiet_builder_class(mg)(mg.GPTDataset, sizes, lambda: True, config)
    splits = _build_locked(builder, cache)
    wrapped = [GPTSamples(ds, name) if ds is not None else None for ds, name in zip(splits, SPLIT_NAMES)]
    return GPTDatasets(*wrapped, tokenizer=tokenizer, blend=blend, notices=tuple(notices))


def _files_fingerprint(blend: Blend) -> str:
    """Names the cache folder by the .bin/.idx files' sizes and modification times (megatron-core's key does not
    cover the files' contents: a dataset rewritten at a prefix would get the old one's sample indices)."""
    stats = []
    for prefix in blend.prefixes:
        for suffix in (".bin", ".idx"):
            st = os.stat(prefix + suffix)
            stats.append(f"{os.path.abspath(prefix)}{suffix}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.md5("\n".join(stats).encode()).hexdigest()


def _mock_datasets(data_config, tokenizer, seq_length: int, seed: int, num_samples) -> GPTDatasets:
    """--mock-data: megatron-core's MockGPTDataset (documents of counting token ids, each ended by EOD)."""
    sizes = [max(1, s) if s is not None else 1 for s in num_samples]
    mg = megatron_datasets()
    config = mg.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=None,
        split=data_config.split,
        path_to_cache=os.path.join(default_cache_dir(data_config.data_cache_path), "indices"),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=data_config.eod_mask_loss,
        create_attention_mask=False,
    )
    builder = _quiet_builder_class(mg)(mg.MockGPTDataset, sizes, lambda: True, config)
    splits = _build_locked(builder, config.path_to_cache)
    wrapped = [
        GPTSamples(ds, name) if ds is not None and num_samples[i] != 0 else None
        for i, (ds, name) in enumerate(zip(splits, SPLIT_NAMES))
    ]
    return GPTDatasets(*wrapped, tokenizer=tokenizer, blend=Blend(()))


def _list(weights):
    return None if weights is None else list(weights)


def _requested_sizes(num_samples: Sequence[Optional[int]], blend: Blend) -> list:
    sizes = list(num_samples)
    if len(sizes) != 3 or any(s is not None and s < 0 for s in sizes):
        raise ValueError(f"num_samples={num_samples!r}: expected (train, valid, test), each >= 0 or None")
    if blend.weights is not None and any(s is None for s in sizes):
        raise ValueError("a weighted --data-path needs a sample count for every split (num_samples)")
    return sizes


def _usable_splits(
    split_matrix, lengths: Dict[str, np.ndarray], sizes, seq_length: int, split_flag: str, report: Callable[[str], None]
):
    """The split matrix with unbuildable splits set to None; DataError where one is required.

    Train is required; valid is required when samples are requested from it; test is dropped, and `report`
    told, when too small (with the default 969,30,1 a small corpus leaves it empty).
    """
    if split_matrix[0] is None:
        raise DataError(f"--split={split_flag}: the train weight (first number) must be > 0")
    matrix = list(split_matrix)
    for i, name in enumerate(SPLIT_NAMES):
        if matrix[i] is None or sizes[i] == 0:
            matrix[i] = None
            continue
        for prefix, lens in lengths.items():
            beg, end = (int(round(b * len(lens))) for b in matrix[i])
            tokens = int(lens[beg:end].sum())
            if tokens >= seq_length + 1:
                continue
            if name == "test":  # the run goes on without a test evaluation, and says so
                report(
                    f"--split={split_flag}: the test split of {prefix} gets {tokens} tokens, fewer than one "
                    f"sample of --seq-length + 1 = {seq_length + 1}: no test evaluation"
                )
                matrix[i] = None
                break
            raise DataError(
                f"--split={split_flag}: the {name} split of {prefix} gets documents [{beg}, {end}) of "
                f"{len(lens)} ({tokens} tokens), fewer than one sample of --seq-length + 1 = "
                f"{seq_length + 1} tokens; use more data, a smaller --seq-length or another --split"
            )
    return matrix


def _build_locked(builder, cache: str):
    """Run megatron-core's builder; a file lock serialises processes that share no process group. An index file
    that was in the cache before the build and that it cannot read (a build killed half-way, or another job's
    still being written) is one DataError naming it."""
    import torch.distributed as dist
    from filelock import FileLock

    started = time.time()
    try:
        if dist.is_available() and dist.is_initialized():
            return builder.build()  # rank 0 first, then a barrier, inside megatron-core
        os.makedirs(cache, exist_ok=True)
        with FileLock(os.path.join(cache, ".build.lock")):
            return builder.build()
    except DataError:  # a pickled index file (index_cache), already named
        raise
    except (ValueError, EOFError, OSError) as error:
        if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:  # the build's own write failed
            raise
        damaged = _unreadable_index_files(cache, written_before=started)
        if not damaged:
            raise
        raise DataError(
            f"--data-cache-path: the dataset index file {damaged[0]} cannot be read ({error}): a build "
            "killed half-way, or another job's build still writing it; delete the file (it is rebuilt) "
            "or wait for the other job"
        ) from error


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS)


def _unreadable_index_files(cache: str, written_before: float) -> List[str]:
    """The .npy files in `cache` (not its subfolders: other datasets' caches) older than `written_before` that
    numpy cannot open (as plain arrays: a pickle is never loaded)."""
    out = []
    for name in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        path = os.path.join(cache, name)
        if not name.endswith(".npy") or os.path.getmtime(path) >= written_before:
            continue
        try:
            np.load(path, allow_pickle=False, mmap_mode="r")
        except (ValueError, EOFError, OSError):
            out.append(path)
    return out


def _quiet_builder_class(mg):
    """megatron-core's builder, with blend indices kept in memory when there is no process group, and a refused
    index file (a pickle) refused on every rank: rank 0 still reaches the barrier the others wait at, and they
    then read the same file."""

    class Builder(mg.BlendedMegatronDatasetBuilder):
        @staticmethod
        def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
            if cls.__name__ == "BlendedDataset" and not torch.distributed.is_initialized():
                config = copy.copy(args[-1])
                config.path_to_cache = None  # its cache path calls dist.get_rank() unguarded
                args = (*args[:-1], config)
            build = mg.BlendedMegatronDatasetBuilder.build_generic_dataset
            if not (synchronize_ranks and torch.distributed.is_initialized() and torch.distributed.get_rank() == 0):
                return build(cls, is_built_on_rank, synchronize_ranks, *args)
            try:
                return build(cls, is_built_on_rank, synchronize_ranks, *args)
            except DataError:
                torch.distributed.barrier()
                raise

    return Builder
