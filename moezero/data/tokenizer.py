"""Tokenizers: a built-in byte-level one, GPT-2's BPE (Megatron's GPT2BPETokenizer, from --vocab-file and
--merge-file, on the `tokenizers` package), a local HuggingFace tokenizer in the forms the Hub families ship
(hub_tokenizer.py), a SentencePiece model
(SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, on `sentencepiece`), Megatron's
TikTokenizer (a tiktoken vocabulary, on `tiktoken`) and Megatron's NullTokenizer (ids as text).

Each exposes what the data layer and megatron-core's GPT dataset read: `vocab_size`, `eod`,
`tokenize(text) -> list[int]`, `detokenize(ids) -> str` and `unique_identifiers` (megatron-core
hashes it into the names of its cached sample indices, so a different tokenizer never reuses them), and
`vocab_items()`, every (id, token) of its vocabulary (the tokenizer record of preprocessed data hashes them).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Iterable, List

from moezero.data.errors import DataError
from moezero.data.hub_tokenizer import HuggingFaceTokenizer
from moezero.data.tiktoken_tokenizer import DEFAULT_VOCAB_SIZE, TikTokenizer


class ByteLevelTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one end-of-document token (256).

    Needs no vocabulary file and round-trips any text exactly, so the default run trains on
    real text with nothing to download.
    """

    eod = 256
    vocab_size = 257

    def __init__(self):
        self.unique_identifiers = OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size, eod=self.eod)

    def tokenize(self, text: str) -> List[int]:
        """The UTF-8 bytes of `text` as token ids (no EOD appended)."""
        return list(text.encode("utf-8"))

    def tokenize_bytes(self, data: bytes) -> List[int]:
        """Raw bytes as token ids: the same ids `tokenize` gives for their UTF-8 decoding."""
        return list(data)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text from token ids; EOD tokens are dropped, invalid UTF-8 is replaced."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def vocab_items(self):
        return [(i, bytes([i])) for i in range(256)] + [(self.eod, "<eod>")]


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE from a vocab.json and a merges.txt (Megatron's `--tokenizer-type
    GPT2BPETokenizer --vocab-file --merge-file`); the end-of-document token is <|endoftext|>."""

    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not os.path.isfile(path):
                raise DataError(f"{flag}={path!r}: no such file")
        tokenizers = _tokenizers_package("GPT2BPETokenizer")
        try:
            tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(vocab_file, merge_file))
        except Exception as exc:  # the package's errors carry no type of their own
            raise DataError(
                f"--vocab-file={vocab_file!r} / --merge-file={merge_file!r}: not GPT-2 BPE files "
                f"({str(exc).splitlines()[0][:200]})"
            ) from None
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        vocab = tok.get_vocab(with_added_tokens=True)
        if self.EOD_TOKEN not in vocab:
            raise DataError(f"--vocab-file={vocab_file!r}: has no {self.EOD_TOKEN} token (GPT-2's end of document)")
        self._tok, self.eod, self.vocab_size = tok, vocab[self.EOD_TOKEN], max(vocab.values()) + 1
        self.unique_identifiers = OrderedDict(
            cls=type(self).__name__,
            vocab_file=os.path.abspath(vocab_file),
            merge_file=os.path.abspath(merge_file),
            vocab_size=self.vocab_size,
        )

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def vocab_items(self):
        return [(i, token) for token, i in self._tok.get_vocab(with_added_tokens=True).items()]


class SentencePieceTokenizer:
    """A SentencePiece model, as megatron-core's SentencePiece library builds it for `--tokenizer-type
    SentencePieceTokenizer` and `GPTSentencePieceTokenizer`: the model's pieces, no BOS added, EOS ends a document.
    Needs the `sentencepiece` package (an optional extra)."""

    adds_bos = False

    def __init__(self, model_file: str):
        kind = type(self).__name__
        if not os.path.isfile(model_file):
            raise DataError(f"--tokenizer-model={model_file!r}: no such file (a SentencePiece tokenizer.model)")
        try:
            import sentencepiece
        except ImportError:
            raise DataError(
                f"--tokenizer-type={kind} needs the `sentencepiece` package (pip install sentencepiece)"
            ) from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except Exception as exc:  # its errors carry no type of their own
            raise DataError(
                f"--tokenizer-model={model_file!r}: not a SentencePiece model ({str(exc).splitlines()[0][:200]})"
            ) from None
        self.vocab_size, self.bos, self.eod = self._sp.vocab_size(), self._sp.bos_id(), self._sp.eos_id()
        if self.eod < 0:
            raise DataError(f"--tokenizer-model={model_file!r}: has no end-of-sentence token")
        self.unique_identifiers = OrderedDict(
            cls=kind, path=os.path.abspath(model_file), vocab_size=self.vocab_size, eod=self.eod
        )

    def tokenize(self, text: str) -> List[int]:
        return ([self.bos] if self.adds_bos and self.bos >= 0 else []) + self._sp.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def vocab_items(self):
        return [(i, self._sp.id_to_piece(i)) for i in range(self.vocab_size)]


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    """Megatron's name for the same SentencePiece tokenizer."""


class Llama2Tokenizer(SentencePieceTokenizer):
    """A SentencePiece model (Megatron's `--tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model`):
    each document starts with BOS (Megatron's Llama-2 tokenizer before megatron-core's tokenizer library), and
    EOS ends it."""

    adds_bos = True


class NullTokenizer:
    """Megatron's NullTokenizer: text is space-separated token ids below `--vocab-size`, and the end of
    document is one more id (so the vocabulary holds vocab_size + 1); for --mock-data and pre-tokenized text."""

    def __init__(self, vocab_size: int):
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1
        self.unique_identifiers = OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size)

    def tokenize(self, text: str) -> List[int]:
        return [int(word) for word in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def vocab_items(self):
        return [(i, str(i)) for i in range(self.vocab_size - 1)] + [(self.eod, "<eod>")]


def _tokenizers_package(user: str):
    try:
        import tokenizers
        import tokenizers.decoders
        import tokenizers.models
        import tokenizers.pre_tokenizers
    except ImportError:
        raise DataError(f"--tokenizer-type={user} needs the `tokenizers` package (pip install tokenizers)") from None
    return tokenizers


SENTENCEPIECE = {cls.__name__: cls for cls in (SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer)}


def build_tokenizer(data_config):
    """The tokenizer that `--tokenizer-type` (and its files) of a `DataConfig` select."""
    kind = data_config.tokenizer_type
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if kind == "GPT2BPETokenizer":
        return GPT2BPETokenizer(data_config.vocab_file, data_config.merge_file)
    if kind in SENTENCEPIECE:
        return SENTENCEPIECE[kind](data_config.tokenizer_model)
    if kind == "TikTokenizer":
        return TikTokenizer(
            data_config.tokenizer_model,
            data_config.tiktoken_pattern or "v2",
            data_config.tiktoken_num_special_tokens,
            data_config.vocab_size or DEFAULT_VOCAB_SIZE,
        )
    if kind == "NullTokenizer":
        return NullTokenizer(data_config.vocab_size)
    return HuggingFaceTokenizer(data_config.tokenizer_model)
