"""The tokenizers Megatron scripts name, against megatron-core's own tokenizer library (installed): TikTokenizer
(a tiktoken vocabulary trained here, written in megatron-core's JSON format) and SentencePieceTokenizer /
GPTSentencePieceTokenizer (a SentencePiece model trained here) give megatron-core's ids, end-of-document token
and vocabulary size; preprocessing writes those ids; bad files and flags are one line."""

import base64
import json
import os

import numpy as np
import pytest

from moezero.config import DataConfig
from moezero.data import DataError, build_tokenizer
from moezero.data.tiktoken_tokenizer import PATTERNS
from tests.bpe_files import CORPUS_JSONL, write_sentencepiece_model
from tests.integration.scripts import tool_in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    "The expert routes token 42 to layer 7.",
    "  two  spaces\tand a tab\n",
    "naïve café — ünïcödé ✓ 漢字",
    "special <s> and </s> inside",
    "",
    "x" * 50,
]


def _corpus() -> str:
    with open(CORPUS_JSONL) as f:
        return "\n".join(json.loads(line)["text"] for line in f if line.strip())[:20000]


@pytest.fixture(scope="module")
def tiktoken_vocab(tmp_path_factory):
    """A byte-level BPE of 400 ranks trained on the test corpus, in megatron-core's tiktoken JSON format."""
    from tiktoken._educational import bpe_train

    ranks = bpe_train(_corpus(), 400, PATTERNS["v2"], visualise=None)
    path = str(tmp_path_factory.mktemp("tiktoken") / "vocab.json")
    with open(path, "w") as f:
        json.dump(
            [
                {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
                for t, r in sorted(ranks.items(), key=lambda item: item[1])
            ],
            f,
        )
    return path


@pytest.mark.parametrize("pattern,special,vocab_size", [("v2", 1000, 1400), ("v1", 10, 300)])
def test_tiktokenizer_equals_megatron_core(tiktoken_vocab, pattern, special, vocab_size):
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

    theirs = TikTokenTokenizer(tiktoken_vocab, num_special_tokens=special, pattern=pattern, vocab_size=vocab_size)
    ours = build_tokenizer(
        DataConfig(
            tokenizer_type="TikTokenizer",
            tokenizer_model=tiktoken_vocab,
            tiktoken_pattern=pattern,
            tiktoken_num_special_tokens=special,
            vocab_size=vocab_size,
        )
    )
    for text in TEXTS + [_corpus()[:3000]]:
        assert ours.tokenize(text) == theirs.text_to_ids(text)
        assert ours.detokenize(ours.tokenize(text)) == text
    assert (ours.eod, ours.vocab_size) == (theirs.eod, vocab_size)


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
def test_sentencepiece_types_equal_megatron_core(tmp_path, kind):
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import SentencePieceTokenizer

    model = write_sentencepiece_model(str(tmp_path))
    theirs = SentencePieceTokenizer(model)
    ours = build_tokenizer(DataConfig(tokenizer_type=kind, tokenizer_model=model))
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.text_to_ids(text)  # no BOS, as megatron-core's library
    assert (ours.eod, ours.vocab_size) == (theirs.eod, theirs.vocab_size)


def test_preprocessing_writes_megatron_cores_ids(tiktoken_vocab, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

    prefix = str(tmp_path / "corpus")
    argv = ["--input", CORPUS_JSONL, "--output-prefix", prefix, "--tokenizer-type", "TikTokenizer", "--append-eod"]
    prep = tool_in_process("preprocess_data", argv + ["--tokenizer-model", tiktoken_vocab, "--vocab-size", "1400"])
    assert prep.returncode == 0, prep.stderr
    theirs = TikTokenTokenizer(tiktoken_vocab, vocab_size=1400)
    with open(CORPUS_JSONL) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    dataset = IndexedDataset(prefix + "_text_document")
    assert len(dataset) == len(texts)
    for i in (0, len(texts) // 2, len(texts) - 1):
        assert np.asarray(dataset[i]).tolist() == theirs.text_to_ids(texts[i]) + [theirs.eod]


def test_bad_tiktoken_input_is_one_line(tiktoken_vocab, tmp_path):
    not_json = tmp_path / "bad.json"
    not_json.write_text("{not json")
    cases = [
        (DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=str(not_json)), "not a tiktoken vocabulary"),
        (
            DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=tiktoken_vocab),
            "fewer than --vocab-size minus --tiktoken-num-special-tokens (130072)",
        ),
        (
            DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=tiktoken_vocab, vocab_size=1100),
            "--vocab-size: leaves 100 tokens",
        ),
    ]
    for config, needle in cases:
        with pytest.raises(DataError) as info:
            build_tokenizer(config)
        assert needle in str(info.value) and "\n" not in str(info.value)
