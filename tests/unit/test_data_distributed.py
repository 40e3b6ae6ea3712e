"""build_datasets on 2 gloo ranks: the default corpus and the index caches are built once (rank 0
first, the other rank waits), and both ranks read identical samples for the same global index."""

import os

import pytest
import torch

from moezero.config import DataConfig
from tests.dist_utils import run_distributed


def _build_on_every_rank(cache_dir):
    from moezero.data import build_datasets, load_micro_batch, train_micro_batches
    import torch.distributed as dist

    cfg = DataConfig(data_cache_path=cache_dir, default_corpus_max_files=8, split="6,2")
    ds = build_datasets(cfg, 64, seed=5, num_samples=(16, 4, 0))
    mine = [load_micro_batch(ds.train, mb) for mb in train_micro_batches(0, 8, 2, dist.get_rank(), 2)]
    every = load_micro_batch(ds.train, range(8))["tokens"]
    return every, torch.cat([b["sample_index"] for b in mine]), torch.cat([b["tokens"] for b in mine])


@pytest.mark.world_size(2)
def test_two_ranks_build_once_and_read_the_same_samples(tmp_path):
    (every0, idx0, tok0), (every1, idx1, tok1) = run_distributed(_build_on_every_rank, 2, str(tmp_path))
    assert torch.equal(every0, every1)
    assert torch.equal(tok0, every0[idx0]) and torch.equal(tok1, every0[idx1])
    assert sorted(idx0.tolist() + idx1.tolist()) == list(range(8))
    corpus = [d for d in os.listdir(tmp_path / "corpus") if not d.endswith(".lock")]
    assert len(corpus) == 1 and not [d for d in corpus if ".tmp" in d]
