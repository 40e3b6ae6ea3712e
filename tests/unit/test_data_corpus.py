"""The default stdlib corpus, tools/preprocess_data.py and the committed test corpus."""

import filecmp
import importlib.util
import json
import multiprocessing
import os
import sys
from pathlib import Path

import numpy as np

from moezero.config import DataConfig
from moezero.data import ByteLevelTokenizer, build_datasets, open_indexed_dataset
from moezero.data.default_corpus import build_default_corpus, stdlib_source_files

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "tests" / "assets" / "corpus"


def preprocess_main(argv):
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module  # so worker processes can unpickle its functions
    spec.loader.exec_module(module)
    return module.main(argv)


def test_stdlib_file_list_is_sorted_capped_and_clean():
    files = stdlib_source_files(50)
    assert len(files) == 50 and files == sorted(files)
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.split("/"))


def test_default_corpus_is_built_once_and_deterministic(tmp_path):
    tok = ByteLevelTokenizer()
    a = build_default_corpus(str(tmp_path / "a"), 6, tok)
    b = build_default_corpus(str(tmp_path / "b"), 6, tok)
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(a + ext, b + ext, shallow=False)
    mtime = os.path.getmtime(a + ".bin")
    assert build_default_corpus(str(tmp_path / "a"), 6, tok) == a and os.path.getmtime(a + ".bin") == mtime
    files = Path(a).with_name("files.txt").read_text().split()
    ds = open_indexed_dataset(a)
    assert len(ds) == 6 and ds[0][-1] == tok.eod
    assert tok.detokenize(ds[0]) == (Path(__import__("sysconfig").get_paths()["stdlib"]) / files[0]).read_text()
    assert not [p for p in os.listdir(Path(a).parent.parent) if ".tmp" in p]
    os.truncate(a + ".bin", 10)  # a damaged cache is rebuilt, not trusted
    assert build_default_corpus(str(tmp_path / "a"), 6, tok) == a and filecmp.cmp(a + ".bin", b + ".bin", False)


def _build_corpus(cache_dir, queue):
    queue.put(build_default_corpus(cache_dir, 6, ByteLevelTokenizer()))


def test_concurrent_builders_share_one_corpus(tmp_path):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_corpus, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    prefixes = {queue.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
    assert len(prefixes) == 1 and all(p.exitcode == 0 for p in procs)
    name = Path(prefixes.pop()).parent.name
    assert sorted(os.listdir(tmp_path / "corpus")) == [name, name + ".lock"]  # no leftover temporaries


def test_build_datasets_defaults_to_the_stdlib_corpus(tmp_path):
    cfg = DataConfig(data_cache_path=str(tmp_path), default_corpus_max_files=40)
    ds = build_datasets(cfg, 64, seed=1, num_samples=(32, 8, 8))
    assert len(ds.train) >= 32 and len(ds.valid) >= 8
    assert ds.blend.prefixes[0].startswith(str(tmp_path))


def test_preprocess_jsonl_and_text_with_workers(tmp_path):
    rows = [{"text": f"document {i} " * (i + 1), "title": f"t{i}"} for i in range(30)]
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = tmp_path / "notes.txt"
    text.write_text("plain text file\n")
    for workers in (1, 2):
        assert (
            preprocess_main(
                [
                    "--input",
                    str(jsonl),
                    str(text),
                    "--output-prefix",
                    str(tmp_path / f"w{workers}"),
                    "--json-keys",
                    "text",
                    "title",
                    "--append-eod",
                    "--workers",
                    str(workers),
                ]
            )
            == 0
        )
    for name in ("text", "title"):
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(
                tmp_path / f"w1_{name}_document{ext}", tmp_path / f"w2_{name}_document{ext}", shallow=False
            )
    tok = ByteLevelTokenizer()
    ds = open_indexed_dataset(str(tmp_path / "w1_text_document"))
    assert len(ds) == 31
    assert tok.detokenize(ds[2]) == rows[2]["text"] and ds[2][-1] == tok.eod
    assert tok.detokenize(ds[30]) == "plain text file\n"
    assert len(open_indexed_dataset(str(tmp_path / "w1_title_document"))) == 30


def test_preprocess_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    assert preprocess_main(["--input", str(bad), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:2: not a JSON object with key 'text'" in capsys.readouterr().err


def test_committed_corpus_matches_its_jsonl(tmp_path):
    assert (
        preprocess_main(
            [
                "--input",
                str(ASSETS / "corpus.jsonl"),
                "--output-prefix",
                str(tmp_path / "corpus"),
                "--json-keys",
                "text",
                "--append-eod",
            ]
        )
        == 0
    )
    for ext in (".bin", ".idx", ".tokenizer-record.json"):
        assert filecmp.cmp(
            tmp_path / f"corpus_text_document{ext}", ASSETS / f"corpus_text_document{ext}", shallow=False
        )
    ds = open_indexed_dataset(str(ASSETS / "corpus_text_document"))
    assert len(ds) == 65 and int(np.sum(ds.sequence_lengths)) < 100_000


def test_a_tokenizer_rewritten_at_the_same_path_builds_its_own_corpus(tmp_path):
    """The cached default corpus is keyed by the tokenizer files' contents, not their path: another tokenizer of
    the same size and end-of-document id (two ids swapped) saved over the first, its mtime kept as cp -p keeps
    it, tokenizes afresh instead of reusing the first one's ids."""
    from moezero.data.tokenizer import HuggingFaceTokenizer
    from tests.bpe_files import write_bpe_files

    path = write_bpe_files(str(tmp_path / "a"))["tokenizer_json"]
    first = build_default_corpus(str(tmp_path / "cache"), 3, HuggingFaceTokenizer(path))
    stat = os.stat(path)
    blob = json.loads(Path(path).read_text())
    vocab = blob["model"]["vocab"]
    vocab["e"], vocab["t"] = vocab["t"], vocab["e"]
    Path(path).write_text(json.dumps(blob))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    tokenizer = HuggingFaceTokenizer(path)
    second = build_default_corpus(str(tmp_path / "cache"), 3, tokenizer)
    assert second != first
    source = (Path(__import__("sysconfig").get_paths()["stdlib"]) / stdlib_source_files(3)[0]).read_text()
    old, new = open_indexed_dataset(first), open_indexed_dataset(second)  # (a view outlives no dataset)
    assert list(new[0][:-1]) == tokenizer.tokenize(source) != list(old[0][:-1])


def test_a_damaged_index_cache_is_one_error_naming_the_file(tmp_path):
    """A sample-index file cut short (a build killed half-way, or another job's being written): one DataError
    naming it and what to do, not numpy's 'mmap length is greater than file size' from inside megatron-core."""
    import pytest

    from moezero.data import DataError
    from tests.integration.pretrain_utils import CORPUS

    data = DataConfig(data_path=[CORPUS], split="98,2,0", data_cache_path=str(tmp_path))
    build_datasets(data, 32, 1, num_samples=(8, 0, 0))
    index = sorted(p for p in (tmp_path / "indices").rglob("*shuffle_index.npy"))[0]
    os.truncate(index, 200)
    with pytest.raises(
        DataError, match=f"--data-cache-path: the dataset index file {index} cannot be read .*delete the file"
    ):
        build_datasets(data, 32, 1, num_samples=(8, 0, 0))
    os.remove(index)  # as the message says: rebuilt
    assert len(build_datasets(data, 32, 1, num_samples=(8, 0, 0)).train) >= 8
