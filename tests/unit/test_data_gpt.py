"""Train/valid/test samples built by megatron-core's GPT dataset, against a direct reference."""

import re

import numpy as np
import pytest
import torch

from moezero.config import DataConfig
from moezero.data import ByteLevelTokenizer, DataError, build_datasets, write_indexed_dataset
from tests.unit.test_data import random_docs

S = 32


@pytest.fixture
def corpus(tmp_path):
    docs = random_docs(40, seed=1)
    prefix = str(tmp_path / "corpus")
    write_indexed_dataset(prefix, docs, vocab_size=257)
    return prefix, docs


def config(tmp_path, data_path, split="80,10,10", cache="cache"):
    return DataConfig(data_path=data_path, split=split, data_cache_path=str(tmp_path / cache))


def reference_samples(docs, split_docs, seed, seq_length):
    """Megatron's GPT sample order, written out: shuffle the split's documents (seeded), concatenate
    them, cut windows of seq_length + 1 tokens every seq_length tokens, then shuffle the windows."""
    rng = np.random.RandomState(seed)
    order = np.array(split_docs, dtype=np.int32)
    rng.shuffle(order)
    stream = np.concatenate([docs[d] for d in order])
    n = (len(stream) - 1) // seq_length
    windows = [stream[k * seq_length : k * seq_length + seq_length + 1] for k in range(n)]
    shuffle = np.arange(n, dtype=np.uint32)
    rng.shuffle(shuffle)
    return [windows[k] for k in shuffle]


def test_samples_equal_the_reference_windows(tmp_path, corpus):
    prefix, docs = corpus
    ds = build_datasets(config(tmp_path, prefix), S, seed=7)
    splits = {"train": range(0, 32), "valid": range(32, 36), "test": range(36, 40)}  # 80,10,10 of 40 docs
    for name, doc_ids in splits.items():
        samples = getattr(ds, name)
        ref = reference_samples(docs, doc_ids, 7, S)
        assert len(samples) == len(ref)
        for i in (0, 1, len(ref) // 2, len(ref) - 1):
            s = samples[i]
            assert s["tokens"].dtype == torch.long and s["tokens"].shape == (S,)
            np.testing.assert_array_equal(s["tokens"].numpy(), ref[i][:-1])
            np.testing.assert_array_equal(s["labels"].numpy(), ref[i][1:])
            assert s["loss_mask"].dtype == torch.float32 and bool((s["loss_mask"] == 1).all())
    with pytest.raises(IndexError, match="out of range"):
        ds.train[len(ds.train)]


def test_split_and_shuffle_are_deterministic_for_a_seed(tmp_path, corpus):
    prefix, _ = corpus
    a = build_datasets(config(tmp_path, prefix, cache="c1"), S, seed=3, num_samples=(500, 20, 0))
    b = build_datasets(config(tmp_path, prefix, cache="c2"), S, seed=3, num_samples=(500, 20, 0))
    c = build_datasets(config(tmp_path, prefix, cache="c1"), S, seed=4, num_samples=(500, 20, 0))
    assert a.test is None and len(a.train) >= 500  # 500 samples need several epochs
    for i in (0, 17, 499):
        assert torch.equal(a.train[i]["tokens"], b.train[i]["tokens"])
    assert torch.equal(a.valid[5]["tokens"], b.valid[5]["tokens"])
    assert any(not torch.equal(a.train[i]["tokens"], c.train[i]["tokens"]) for i in range(5))


def test_weighted_blend(tmp_path, corpus):
    prefix, _ = corpus
    other = str(tmp_path / "other")
    write_indexed_dataset(other, [np.full(50, 7)] * 30, vocab_size=257)
    ds = build_datasets(config(tmp_path, f"1 {prefix} 3 {other}"), S, seed=1, num_samples=(400, 40, 40))
    assert len(ds.train) == 400
    from_other = sum(bool((ds.train[i]["tokens"] == 7).all()) for i in range(400))
    assert 250 < from_other < 330  # about 3/4 of the samples (windows may span documents)


def test_too_small_and_bad_split_errors(tmp_path, corpus):
    prefix, _ = corpus
    with pytest.raises(DataError, match=r"train split .*fewer than one sample of --seq-length \+ 1 = 100001"):
        build_datasets(config(tmp_path, prefix), 100000, seed=1)
    with pytest.raises(DataError, match="--split=0,1,1: the train weight"):
        build_datasets(config(tmp_path, prefix, split="0,1,1"), S, seed=1)
    with pytest.raises(DataError, match="--split=99,1,0: the valid split"):  # 0 of 40 docs
        build_datasets(config(tmp_path, prefix, split="99,1,0"), S, seed=1, num_samples=(10, 10, 0))
    ok = build_datasets(config(tmp_path, prefix, split="99,1,0"), S, seed=1, num_samples=(10, 0, 0))
    assert ok.valid is None and ok.test is None
    with pytest.raises(DataError, match=r"--data-path: .*missing\.idx does not exist"):
        build_datasets(config(tmp_path, str(tmp_path / "missing")), S, seed=1)


def test_a_blend_weight_of_zero_is_one_line_naming_the_flag(tmp_path, corpus):
    prefix, _ = corpus
    with pytest.raises(DataError, match="--data-path=.*weights must be > 0"):
        build_datasets(config(tmp_path, f"0 {prefix} 1 {prefix}"), S, seed=1)


def test_a_dataset_rewritten_at_its_prefix_gets_sample_indices_of_its_own(tmp_path, corpus):
    """megatron-core's cache key describes the files (path, split, seed), not their contents: a prefix rewritten
    with other documents reused the old indices (and crashed reading past them)."""
    prefix, _ = corpus
    first = build_datasets(config(tmp_path, prefix), S, seed=7)
    write_indexed_dataset(prefix, random_docs(55, seed=2), vocab_size=257)
    again = build_datasets(config(tmp_path, prefix), S, seed=7)
    fresh = build_datasets(config(tmp_path, prefix, cache="fresh"), S, seed=7)
    assert len(again.train) == len(fresh.train) != len(first.train)
    for i in (0, len(fresh.train) - 1):
        assert torch.equal(again.train[i]["tokens"], fresh.train[i]["tokens"])


def test_a_test_split_shorter_than_a_sample_is_dropped_and_the_log_says_so(tmp_path):
    prefix = str(tmp_path / "short_tail")
    # 90,5,5 of 20 documents: the valid split one of 100 tokens, the test split one of 10
    docs = random_docs(18, seed=3) + [np.append(np.arange(99) % 256, 256), np.append(np.arange(9), 256)]
    write_indexed_dataset(prefix, docs, vocab_size=257, tokenizer=ByteLevelTokenizer())
    ds = build_datasets(config(tmp_path, prefix, split="90,5,5"), S, seed=1)
    assert ds.test is None and ds.valid is not None
    assert len(ds.notices) == 1 and re.search("the test split of .* gets 10 tokens.*no test evaluation", ds.notices[0])
