"""The dataset index cache (--data-cache-path) is read as plain arrays: a pickle planted under the name of one of
megatron-core's index files is refused in one error naming it, on every rank, and never runs."""

import os
import pickle
import time

import numpy as np
import pytest

from moezero.config import DataConfig
from moezero.data import DataError, build_datasets
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import CORPUS


class _WritesMarker:
    """Unpickled, it creates the file `path` (what a planted pickle could do: run any code)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(cache, marker, which="document_index", as_npy=False):
    """A pickle saved over the cache's `which` index file (a raw pickle, or an object array in a .npy)."""
    index = sorted((cache / "indices").rglob(f"*train-{which}.npy"))[0]
    if as_npy:
        np.save(index, np.array([_WritesMarker(str(marker))], dtype=object), allow_pickle=True)
    else:
        index.write_bytes(pickle.dumps(_WritesMarker(str(marker))))
    return index


def _data(cache):
    return DataConfig(data_path=[CORPUS], split="98,2,0", data_cache_path=str(cache))


@pytest.mark.parametrize("which, as_npy", [("document_index", False), ("shuffle_index", True)])
def test_a_pickle_in_the_index_cache_is_refused_and_never_runs(tmp_path, which, as_npy):
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    build_datasets(_data(cache), 32, 1, num_samples=(8, 0, 0))
    index = _plant(cache, marker, which, as_npy)
    with pytest.raises(DataError) as refused:
        build_datasets(_data(cache), 32, 1, num_samples=(8, 0, 0))
    message = str(refused.value)
    assert message.startswith(f"--data-cache-path: the dataset index file {index} holds pickled Python objects")
    assert "\n" not in message and not marker.exists()
    os.remove(index)  # as the message says: rebuilt
    assert len(build_datasets(_data(cache), 32, 1, num_samples=(8, 0, 0)).train) >= 8 and not marker.exists()


def test_the_damaged_cache_scan_does_not_unpickle_either(tmp_path):
    """The files moezero itself opens to name a damaged index (older than the build) are opened without pickles:
    the planted one is named as unreadable and does not run."""
    from moezero.data.gpt_dataset import _unreadable_index_files

    cache, marker = tmp_path / "cache", tmp_path / "marker"
    build_datasets(_data(cache), 32, 1, num_samples=(8, 0, 0))
    index = _plant(cache, marker)
    assert _unreadable_index_files(str(index.parent), written_before=time.time() + 10) == [str(index)]
    assert not marker.exists()


def _build_on_every_rank(cache):
    try:
        build_datasets(_data(cache), 32, 1, num_samples=(8, 0, 0))
    except DataError as error:
        return str(error)
    return None


@pytest.mark.world_size(2)
def test_two_ranks_both_refuse_the_pickle(tmp_path):
    """Rank 0 finds it while the other waits at megatron-core's barrier: both refuse it, neither hangs."""
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    build_datasets(_data(cache), 32, 1, num_samples=(8, 0, 0))
    index = _plant(cache, marker)
    errors = run_distributed(_build_on_every_rank, 2, cache)
    assert all(e is not None and f"{index} holds pickled Python objects" in e for e in errors), errors
    assert not marker.exists()
