"""The tokenizer record tools/preprocess_data.py writes beside its datasets: a run with another vocabulary refuses
the data in one line naming both; data with no record, or a record of other files, is taken with one notice. And the
preprocessing's bad inputs: one line, and nothing of a failed run left at the output prefix."""

import json
import os
import shutil

import pytest

from moezero.config import DataConfig
from moezero.data import DataError, build_datasets
from tests.bpe_files import write_bpe_files
from tests.unit.test_data_corpus import preprocess_main

ROWS = [
    {"text": f"document {i}: " + "the experts route tokens. " * (5 + i % 7), "title": f"title {i}"} for i in range(40)
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _build(prefix, tmp_path, **tokenizer):
    data = DataConfig(data_path=[prefix], split="90,10,0", data_cache_path=str(tmp_path / "cache"), **tokenizer)
    return build_datasets(data, 16, 1, num_samples=(4, 0, 0))


def test_data_of_another_tokenizer_is_refused_naming_both(tmp_path, jsonl):
    """Byte-level ids are all below a 400-id BPE vocabulary: without the record the run would train on them."""
    bpe = write_bpe_files(str(tmp_path / "bpe"))["tokenizer_json"]
    hf = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=bpe)
    assert preprocess_main(["--input", str(jsonl), "--output-prefix", str(tmp_path / "bytes"), "--append-eod"]) == 0
    assert (
        preprocess_main(
            [
                "--input",
                str(jsonl),
                "--output-prefix",
                str(tmp_path / "bpe"),
                "--append-eod",
                "--tokenizer-type",
                "HuggingFaceTokenizer",
                "--tokenizer-model",
                bpe,
            ]
        )
        == 0
    )
    bytes_prefix, bpe_prefix = str(tmp_path / "bytes_text_document"), str(tmp_path / "bpe_text_document")
    with pytest.raises(DataError) as refused:
        _build(bytes_prefix, tmp_path, **hf)
    message = str(refused.value)
    assert (
        message.startswith(f"--data-path: {bytes_prefix} was tokenized with ByteLevelTokenizer (257 ids")
        and f"the run's tokenizer is HuggingFaceTokenizer {bpe} (400 ids" in message
        and "\n" not in message
    ), message
    with pytest.raises(
        DataError,
        match=f"{bpe_prefix} was tokenized with HuggingFaceTokenizer {bpe} .*the run's tokenizer is ByteLevelTokenizer",
    ):
        _build(bpe_prefix, tmp_path)
    assert _build(bytes_prefix, tmp_path).notices == () and _build(bpe_prefix, tmp_path, **hf).notices == ()
    moved = tmp_path / "moved.json"  # the same vocabulary elsewhere: the same ids
    shutil.copy(bpe, moved)
    assert _build(bpe_prefix, tmp_path, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(moved)).notices == ()


def test_data_with_no_record_or_a_stale_one_is_taken_with_a_notice(tmp_path, jsonl):
    assert (
        preprocess_main(
            [
                "--input",
                str(jsonl),
                "--output-prefix",
                str(tmp_path / "a"),
                "--append-eod",
                "--json-keys",
                "text",
                "title",
            ]
        )
        == 0
    )
    prefix = str(tmp_path / "a_text_document")
    record = prefix + ".tokenizer-record.json"
    kept = tmp_path / "record.json"
    shutil.move(record, kept)  # as Megatron's tools write: no record
    notices = _build(prefix, tmp_path).notices
    assert (
        len(notices) == 1
        and notices[0].startswith(f"--data-path: {prefix} has no tokenizer record")
        and "taken to be those of the run's tokenizer, ByteLevelTokenizer" in notices[0]
    )
    shutil.move(kept, record)
    for suffix in (".bin", ".idx"):  # other files written over the prefix by a tool that keeps no record
        shutil.copy(str(tmp_path / "a_title_document") + suffix, prefix + suffix)
    notices = _build(prefix, tmp_path).notices
    assert len(notices) == 1 and f"the tokenizer record {record} describes other files" in notices[0]


def test_a_failed_preprocess_leaves_the_prefix_as_it_was(tmp_path, jsonl, capsys):
    """A line without a later --json-keys key: the keys before it are not left written (nor temporaries), and the
    files an earlier run wrote at the prefix stay."""
    out = str(tmp_path / "out")
    assert preprocess_main(["--input", str(jsonl), "--output-prefix", out]) == 0
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.startswith("out_")}
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:5]) + json.dumps({"text": "no title"}) + "\n")
    assert preprocess_main(["--input", str(broken), "--output-prefix", out, "--json-keys", "text", "title"]) == 2
    assert "broken.jsonl:6: not a JSON object with key 'title'" in capsys.readouterr().err
    after = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.startswith("out_")}
    assert after == before and sorted(before) == [
        "out_text_document.bin",
        "out_text_document.idx",
        "out_text_document.tokenizer-record.json",
    ]


def test_bad_input_and_a_bad_tokenizer_file_are_one_line(tmp_path, jsonl, capsys):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text("this is no tokenizer")
    cases = [
        (["--input", str(latin1)], "latin1.jsonl:2: not UTF-8 text (byte 14 of the line is b'\\xe9')"),
        (
            ["--input", str(jsonl), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(garbage)],
            f"{garbage} is not a Hugging Face tokenizer.json",
        ),
    ]
    for argv, needle in cases:
        assert preprocess_main(argv + ["--output-prefix", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not [name for name in os.listdir(tmp_path) if name.startswith("o_")]
