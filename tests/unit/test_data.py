"""Data layer: tokenizers, indexed files and their errors, the layout-invariant batch order."""

import os
import sys

import numpy as np
import pytest
import torch

from moezero.config import ConfigError, DataConfig
from moezero.data import (
    ByteLevelTokenizer,
    DataError,
    build_tokenizer,
    check_indexed_dataset,
    collate,
    eval_micro_batches,
    load_micro_batch,
    micro_batch_indices,
    num_micro_steps,
    open_indexed_dataset,
    parse_data_path,
    train_micro_batches,
    write_indexed_dataset,
)
from tests.bpe_files import write_bpe_files


def random_docs(n, seed=0, max_len=300, eod=256):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(0, 256, int(rng.integers(1, max_len))), eod) for _ in range(n)]


# ---- tokenizers -----------------------------------------------------------------------------


def test_byte_level_round_trip():
    tok = ByteLevelTokenizer()
    text = "def f(x):\n    return x  # café, 数据, 🙂\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.detokenize(ids + [tok.eod]) == text
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert tok.tokenize_bytes(text.encode()) == ids


def test_huggingface_tokenizer_needs_a_local_path_and_the_package(tmp_path, monkeypatch):
    cfg = DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))
    with pytest.raises(DataError, match="--tokenizer-model=.*no such file"):
        build_tokenizer(cfg)
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(DataError, match="pip install tokenizers"):
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))


def test_gpt2_bpe_and_huggingface_tokenizers_read_files_a_trained_tokenizer_wrote(tmp_path):
    files = write_bpe_files(str(tmp_path))
    text = "def f(x):\n    return x  # café, 数据\n"
    bpe = build_tokenizer(
        DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab"], merge_file=files["merges"])
    )
    hf = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files["tokenizer_json"]))
    ids = bpe.tokenize(text)
    assert len(ids) < len(text.encode()) and hf.tokenize(text) == ids  # merges applied, the same BPE
    assert bpe.detokenize(ids) == text == hf.detokenize(ids)
    assert (bpe.vocab_size, bpe.eod) == (400, 0) and hf.eod == 0  # <|endoftext|>, the first special token


def test_a_huggingface_tokenizers_eod_is_the_eos_token_it_declares(tmp_path):
    """Qwen's instruct tokenizers hold <|endoftext|> and declare <|im_end|> their eos_token: the end-of-document
    token is the declared one (transformers' and megatron-core's eos_token_id), in either spelling."""
    import json
    import shutil

    files = write_bpe_files(str(tmp_path))
    folder = tmp_path / "instruct"
    folder.mkdir()
    shutil.copy(files["tokenizer_json"], folder / "tokenizer.json")
    vocab = json.load(open(files["vocab"]))
    declared = next(token for token, index in vocab.items() if index == 7)
    for config in ({"eos_token": declared}, {"eos_token": {"content": declared, "special": True}}):
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        assert build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder))).eod == 7
    (folder / "tokenizer_config.json").write_text("{}")  # none declared: the usual names
    assert build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder))).eod == 0


def test_gpt2_bpe_flags_go_together(tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer-type=.GPT2BPETokenizer.: GPT2BPETokenizer needs --vocab"):
        DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="v.json")
    with pytest.raises(ConfigError, match="--vocab-file=.*only --tokenizer-type GPT2BPETokenizer reads it"):
        DataConfig(vocab_file="v.json")
    with pytest.raises(DataError, match="--vocab-file=.*no such file"):
        build_tokenizer(
            DataConfig(
                tokenizer_type="GPT2BPETokenizer",
                vocab_file=str(tmp_path / "v.json"),
                merge_file=str(tmp_path / "m.txt"),
            )
        )


# ---- indexed files --------------------------------------------------------------------------


def test_indexed_dataset_round_trip(tmp_path):
    docs = random_docs(20)
    prefix = str(tmp_path / "d")
    summary = write_indexed_dataset(prefix, docs, vocab_size=257)
    assert (summary.num_documents, summary.num_tokens, summary.dtype) == (20, sum(map(len, docs)), np.uint16)
    ds = open_indexed_dataset(prefix)
    assert len(ds) == 20
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.get(3, offset=1, length=2), docs[3][1:3])
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p]  # temporaries renamed away


KILLED_WRITE = """
import sys, time
import numpy as np
from moezero.data import write_indexed_dataset

prefix, marker = sys.argv[1:3]

def documents():
    yield np.arange(1000) % 256
    open(marker, "w").close()
    time.sleep(600)

write_indexed_dataset(prefix, documents(), vocab_size=257)
"""


def test_a_killed_writes_temporary_files_go_with_the_next_write(tmp_path):
    """preprocess_data killed mid-write (SIGKILL: no cleanup) leaves `<prefix>.tmp-<host>-<pid>.bin`; the next
    write of the prefix removes it with a warning, and leaves one of a process still running."""
    import signal
    import socket
    import subprocess
    import time

    prefix, marker = str(tmp_path / "d"), str(tmp_path / "marker")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITE, prefix, marker], env=dict(os.environ, PYTHONPATH=repo)
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert child.poll() is None and time.monotonic() < deadline, "the write never started"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    killed = f"d.tmp-{socket.gethostname()}-{child.pid}.bin"
    running = f"d.tmp-{socket.gethostname()}-{os.getppid()}.idx"  # this process's parent: still running
    (tmp_path / running).write_bytes(b"")
    assert killed in os.listdir(tmp_path)
    with pytest.warns(UserWarning, match=f"removed {killed}, left by a write of it that was killed"):
        write_indexed_dataset(prefix, random_docs(3), vocab_size=257)
    assert sorted(os.listdir(tmp_path)) == sorted(["d.bin", "d.idx", "marker", running])
    assert len(open_indexed_dataset(prefix)) == 3


def test_a_leftover_that_cannot_be_removed_does_not_stop_a_write(tmp_path, monkeypatch):
    """Another user's leftover (removal refused): the write goes on, and the warning says it could not remove it."""
    import socket
    import subprocess

    import moezero.data.indexed as indexed

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    leftover = f"d.tmp-{socket.gethostname()}-{gone.pid}.bin"
    (tmp_path / leftover).write_bytes(b"x")
    removing = indexed.os.remove

    def refuse(path):
        if path.endswith(leftover):
            raise PermissionError(1, "Operation not permitted", path)
        removing(path)

    monkeypatch.setattr(indexed.os, "remove", refuse)
    with pytest.warns(UserWarning, match=f"could not remove {leftover}"):
        write_indexed_dataset(str(tmp_path / "d"), random_docs(3), vocab_size=257)
    assert len(open_indexed_dataset(str(tmp_path / "d"))) == 3


def test_missing_files_name_the_path_and_flag(tmp_path):
    with pytest.raises(DataError, match=r"--data-path: .*nope\.idx does not exist"):
        check_indexed_dataset(str(tmp_path / "nope"))
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, random_docs(3), vocab_size=257)
    os.remove(prefix + ".bin")
    with pytest.raises(DataError, match=r"d\.bin does not exist"):
        open_indexed_dataset(prefix)


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda p: open(p + ".idx", "r+b").write(b"GARBAGE!!"), "bad header"),
        (lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), "truncated"),
        (lambda p: os.truncate(p + ".idx", 5), "only 5 bytes"),
        (lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 2), "truncated, or .bin and .idx"),
    ],
)
def test_corrupt_files_give_one_clear_error(tmp_path, damage, needle):
    prefix = str(tmp_path / "d")
    write_indexed_dataset(prefix, random_docs(5), vocab_size=257)
    damage(prefix)
    with pytest.raises(DataError, match=needle) as info:
        open_indexed_dataset(prefix)
    assert "\n" not in str(info.value)


def test_parse_data_path():
    assert parse_data_path("a").prefixes == ("a",) and parse_data_path("a b").weights is None
    blend = parse_data_path("30 a 70 b")
    assert blend.prefixes == ("a", "b") and blend.weights == (30.0, 70.0)
    for bad in ("", "30 a b", "0 a 0 b", "30 a b 70"):
        with pytest.raises(DataError, match="--data-path"):
            parse_data_path(bad)


# ---- batch order ----------------------------------------------------------------------------


def micro_batches_of_step(step, gbs, mbs, world):
    """{micro-batch number m: indices} over all ranks, from each rank's own schedule."""
    out = {}
    for rank in range(world):
        for j, mb in enumerate(train_micro_batches(step, gbs, mbs, rank, world)):
            out[j * world + rank] = tuple(mb)
    return out


def test_every_world_size_reads_the_same_micro_batches():
    gbs, mbs = 16, 2
    for step in (0, 3):
        ref = micro_batches_of_step(step, gbs, mbs, 1)
        assert [i for m in sorted(ref) for i in ref[m]] == list(range(step * gbs, (step + 1) * gbs))
        for world in (2, 4):
            assert micro_batches_of_step(step, gbs, mbs, world) == ref
    # Megatron's order: rank r's micro-step j reads micro-batch j * dp + r
    assert micro_batch_indices(32, 16, 2, 1, 4) == [[34, 35], [42, 43]]
    assert num_micro_steps(16, 2, 4) == 2


def test_eval_batches_are_layout_invariant():
    ref = eval_micro_batches(3, 8, 2, 0, 1)
    assert [i for mb in ref for i in mb] == list(range(24))
    for world in (2, 4):
        got = sorted(tuple(mb) for r in range(world) for mb in eval_micro_batches(3, 8, 2, r, world))
        assert got == sorted(map(tuple, ref))
        assert len({len(eval_micro_batches(3, 8, 2, r, world)) for r in range(world)}) == 1


def test_batch_sizes_must_divide():
    with pytest.raises(ConfigError, match=r"--global-batch-size \(12\).*--micro-batch-size \(2\).*size \(4\)"):
        num_micro_steps(12, 2, 4)
    with pytest.raises(ConfigError, match="must all be >= 1"):
        num_micro_steps(8, 0, 1)


def test_collate_returns_global_indices():
    samples = {
        i: {"tokens": torch.full((4,), i), "labels": torch.full((4,), i + 1), "loss_mask": torch.ones(4)}
        for i in range(10)
    }
    batch = load_micro_batch(samples, [7, 3])
    assert batch["tokens"].shape == (2, 4) and batch["tokens"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["sample_index"].tolist() == [7, 3] and batch["labels"][:, 0].tolist() == [8, 4]
    assert collate([samples[1]], [1])["tokens"].shape == (1, 4)


def test_a_valid_split_shorter_than_a_sample_is_refused_whatever_follows_it(tmp_path):
    """--split 90,5,5 of 20 documents: the valid split is document 18 alone (10 tokens), fewer than a sample; the
    100-token document after it (the test split's) does not count for it (megatron-core would repeat the one
    short document to fill every validation sample)."""
    from moezero.data import build_datasets

    prefix = str(tmp_path / "short_valid")
    docs = random_docs(18, seed=3) + [np.append(np.arange(9), 256), np.append(np.arange(99) % 256, 256)]
    write_indexed_dataset(prefix, docs, vocab_size=257)
    cfg = DataConfig(data_path=prefix, split="90,5,5", data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(
        DataError,
        match=r"--split=90,5,5: the valid split .* gets documents \[18, 19\) of 20 "
        r"\(10 tokens\)",
    ):
        build_datasets(cfg, 32, seed=1, num_samples=(10, 10, 0))
