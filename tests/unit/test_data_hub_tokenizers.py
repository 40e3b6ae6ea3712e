"""--tokenizer-type HuggingFaceTokenizer reads every form the Hub families ship: tokenizer.json (transformers is the
oracle), a SentencePiece tokenizer.model alone (megatron-core's SentencePiece tokenizer is), Kimi-K2's tiktoken.model
(ids worked out by hand from a vocabulary written here); a folder with none, or a file that is not what its name
says, is one line naming the file."""

import base64
import json
import shutil

import pytest

from moezero.config import DataConfig
from moezero.data import DataError, build_tokenizer
from tests.bpe_files import write_bpe_files, write_sentencepiece_model

TEXTS = ["The expert routes token 42 to layer 7.", "def tokenize(self, text):", "naïve café"]


def _hf(path):
    return build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path)))


def test_a_tokenizer_json_folder_gives_transformers_ids_and_tokens(tmp_path):
    import transformers

    folder = tmp_path / "hub"
    write_bpe_files(str(folder))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    ours, theirs = _hf(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.encode(text, add_special_tokens=False)
    assert (ours.eod, ours.bos) == (theirs.eos_token_id, theirs.bos_token_id)


def test_a_sentencepiece_folder_gives_megatron_cores_ids(tmp_path):
    """A folder with only tokenizer.model (and the tokenizer_config.json declaring its tokens): SentencePiece's ids,
    its declared eos and bos; without a declaration, the model's own."""
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import SentencePieceTokenizer

    model = write_sentencepiece_model(str(tmp_path / "train"))
    folder = tmp_path / "hub"
    folder.mkdir()
    shutil.copy(model, folder / "tokenizer.model")
    theirs = SentencePieceTokenizer(model)
    ours = _hf(folder)
    for text in TEXTS:
        assert ours.tokenize(text) == theirs.text_to_ids(text)
    assert (ours.eod, ours.bos, ours.vocab_size) == (theirs.eod, 1, theirs.vocab_size)
    piece = theirs.ids_to_tokens([20])[0]
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": piece}}))
    assert _hf(folder).eod == 20


def _kimi_folder(folder, ranks, added):
    folder.mkdir()
    with open(folder / "tiktoken.model", "wb") as f:
        f.writelines(base64.b64encode(token) + b" " + str(rank).encode() + b"\n" for token, rank in ranks.items())
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in added.items()},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_kimi.py").write_text("raise SystemExit('moezero ran the folder code')\n")


def test_kimis_tiktoken_model_is_read_as_kimis_code_builds_it(tmp_path):
    """256 byte ranks and three merges ("th" 256, "the" 257, " th" 258); special tokens from id 259 on, as Kimi's
    TikTokenTokenizer numbers them (its 256 reserved ids after the ranks, named by added_tokens_decoder)."""
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"th": 256, b"the": 257, b" th": 258})
    folder = tmp_path / "kimi"
    _kimi_folder(folder, ranks, {259: "[BOS]", 260: "[EOS]", 262: "<|im_end|>"})
    tok = _hf(folder)
    # " then" is one piece of the pattern: the lowest-ranked pair first ("th"), then "the"; " the" is no token
    assert tok.tokenize("the then") == [257, 32, 257, ord("n")]
    assert tok.tokenize("你好") == list("你好".encode())  # a Han run with no merges: its bytes
    assert tok.tokenize("x<|im_end|>[EOS]") == [ord("x"), 262, 260]
    assert (tok.bos, tok.eod, tok.vocab_size) == (259, 260, 259 + 256)
    assert tok.detokenize(tok.tokenize("the then 你好")) == "the then 你好"


def test_a_folder_or_file_that_holds_no_readable_tokenizer_is_one_line(tmp_path):
    cases = []
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    cases.append((empty, "the folder holds no tokenizer (tokenizer.json, tokenizer.model, tiktoken.model"))
    for name, needle in (
        ("tokenizer.json", "is not a Hugging Face tokenizer.json"),
        ("tokenizer.model", "is not a SentencePiece model"),
    ):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(b"\x00garbage{")
        cases.append((folder, f"{folder / name} {needle}"))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json at all")
    cases.append((garbage, f"{garbage} is not a Hugging Face tokenizer.json"))
    kimi = tmp_path / "kimi"
    _kimi_folder(kimi, {b"a": 0}, {})
    (kimi / "tiktoken.model").write_text("YQ== zero\n")
    cases.append((kimi, f"{kimi / 'tiktoken.model'} is not a tiktoken model"))
    unknown = tmp_path / "unknown"
    _kimi_folder(unknown, {bytes([i]): i for i in range(256)}, {})
    (unknown / "tokenizer_config.json").write_text("{}")
    cases.append((unknown, "a tiktoken model whose split pattern moezero does not know"))
    for path, needle in cases:
        with pytest.raises(DataError) as refused:
            _hf(path)
        message = str(refused.value)
        assert needle in message and message.startswith("--tokenizer-model=") and "\n" not in message, message
