"""A local Hugging Face tokenizer (`--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH`), in every form the
supported Hub families ship it:

  tokenizer.json    the `tokenizers` package's file (Mixtral, Qwen, OLMoE, DeepSeek, GLM, GPT-OSS, Llama)
  tokenizer.model   a SentencePiece model, where a folder has no tokenizer.json (Llama-2 style folders)
  tiktoken.model    Kimi-K2's tiktoken ranks with its tokenizer_config.json (see kimi_tokenizer.py)

PATH is a tokenizer.json file or a folder holding one of them (looked for in that order); anything else, or a file
that is not what its name says, is one DataError naming the file. Never downloads, never runs a folder's code.
The end-of-document token is the eos_token the folder's tokenizer_config.json (or special_tokens_map.json)
declares, as transformers and megatron-core's HuggingFaceTokenizer take it, else the form's own (a bare
tokenizer.json declares none: the first of the usual names it holds).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple

from moezero.data.errors import DataError

FORMS = ("tokenizer.json", "tokenizer.model", "tiktoken.model")
_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def tokenizer_file(path: str) -> str:
    """The file a --tokenizer-model path is read from: itself, or the first of FORMS its folder holds."""
    if not os.path.exists(path):
        raise DataError(
            f"--tokenizer-model={path!r}: no such file or directory (a local tokenizer path is needed; "
            "nothing is downloaded)"
        )
    if os.path.isfile(path):
        return path
    for name in FORMS:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise DataError(
        f"--tokenizer-model={path!r}: the folder holds no tokenizer ({', '.join(FORMS)}: looked for in that order)"
    )


class HuggingFaceTokenizer:
    """See the module's docstring. `file` is the file read, `bos` the declared beginning-of-sequence id (None:
    none), `vocab_items()` every (id, token) of the vocabulary (the tokenizer record's hash)."""

    def __init__(self, path: str):
        self.file = tokenizer_file(path)
        self.folder = os.path.dirname(os.path.abspath(self.file))
        name = os.path.basename(self.file)
        reader = (
            _SentencePiece
            if name == "tokenizer.model"
            else _TiktokenModel
            if name == "tiktoken.model"
            else _TokenizersJson
        )
        self._impl = reader(self.file, path, _tokenizer_config(self.folder))
        declared = _declared(self.folder, "eos_token")
        self.eod = self._impl.id_of(declared) if declared is not None else None
        if self.eod is None:
            self.eod = self._impl.default_eod()
        if self.eod is None:
            raise DataError(
                f"--tokenizer-model={path!r}: {self.file} has no end-of-document token (its folder "
                f"declares {declared!r}; looked for {', '.join(_EOD_CANDIDATES)})"
            )
        bos = _declared(self.folder, "bos_token")
        self.bos = self._impl.id_of(bos) if bos is not None else self._impl.default_bos()
        self.vocab_size = self._impl.vocab_size
        self.unique_identifiers = OrderedDict(
            cls=type(self).__name__, path=os.path.abspath(path), vocab_size=self.vocab_size, eod=self.eod
        )

    def tokenize(self, text: str) -> List[int]:
        """Token ids of `text` without special tokens added."""
        return list(self._impl.encode(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._impl.decode([int(i) for i in ids])

    def vocab_items(self) -> Iterable[Tuple[int, object]]:
        return self._impl.vocab_items()


class _TokenizersJson:
    def __init__(self, file: str, path: str, config: Dict):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "--tokenizer-type=HuggingFaceTokenizer needs the `tokenizers` package (pip install "
                "tokenizers), or use --tokenizer-type=ByteLevelTokenizer"
            ) from None
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # the package's errors carry no type of their own
            raise DataError(
                f"--tokenizer-model={path!r}: {file} is not a Hugging Face tokenizer.json ({_first_line(exc)})"
            ) from None
        self._vocab = self._tok.get_vocab(with_added_tokens=True)
        if not self._vocab:
            raise DataError(f"--tokenizer-model={path!r}: {file} holds an empty vocabulary")
        self.vocab_size = max(self._vocab.values()) + 1

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids)

    def id_of(self, token: str) -> Optional[int]:
        return self._vocab.get(token)

    def default_eod(self) -> Optional[int]:
        return next((self._vocab[t] for t in _EOD_CANDIDATES if t in self._vocab), None)

    def default_bos(self) -> Optional[int]:
        return None

    def vocab_items(self):
        return ((i, token) for token, i in self._vocab.items())


class _SentencePiece:
    """tokenizer.model as transformers' SentencePiece tokenizers read it (LlamaTokenizer): the model's pieces."""

    def __init__(self, file: str, path: str, config: Dict):
        try:
            import sentencepiece
        except ImportError:
            raise DataError(
                f"--tokenizer-model={path!r}: {file} is a SentencePiece model, which needs the "
                "`sentencepiece` package (pip install sentencepiece)"
            ) from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=file)
        except Exception as exc:  # its errors carry no type of their own
            raise DataError(
                f"--tokenizer-model={path!r}: {file} is not a SentencePiece model ({_first_line(exc)})"
            ) from None
        self.vocab_size = self._sp.vocab_size()

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def decode(self, ids: List[int]) -> str:
        return self._sp.decode(ids)

    def id_of(self, token: str) -> Optional[int]:
        i = self._sp.piece_to_id(token)
        return i if 0 <= i < self.vocab_size and self._sp.id_to_piece(i) == token else None

    def default_eod(self) -> Optional[int]:
        return self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def default_bos(self) -> Optional[int]:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    def vocab_items(self):
        return ((i, self._sp.id_to_piece(i)) for i in range(self.vocab_size))


class _TiktokenModel:
    def __init__(self, file: str, path: str, config: Dict):
        from moezero.data.kimi_tokenizer import KimiTiktoken

        self._kimi = KimiTiktoken(file, config, flag=f"--tokenizer-model={path!r}")
        self.vocab_size = self._kimi.vocab_size

    def encode(self, text: str) -> List[int]:
        return self._kimi.encode(text)

    def decode(self, ids: List[int]) -> str:
        return self._kimi.decode(ids)

    def id_of(self, token: str) -> Optional[int]:
        return self._kimi.special_tokens.get(token)

    def default_eod(self) -> Optional[int]:
        return self._kimi.special_tokens.get("[EOS]")

    def default_bos(self) -> Optional[int]:
        return self._kimi.special_tokens.get("[BOS]")

    def vocab_items(self):
        return self._kimi.vocab_items()


def _tokenizer_config(folder: str) -> Dict:
    """The folder's tokenizer_config.json ({} where it has none or it is unreadable: the form then says)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _declared(folder: str, field: str) -> Optional[str]:
    """The token a folder's tokenizer_config.json or special_tokens_map.json declares as `field` (None: none)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            with open(os.path.join(folder, name)) as f:
                token = json.load(f).get(field)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(token, dict):  # an AddedToken's fields
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def vocab_digest(items: Iterable[Tuple[int, object]]) -> str:
    """sha256 of a vocabulary's (id, token) pairs in id order (tokens as str or bytes)."""
    h = hashlib.sha256()
    for i, token in sorted(items, key=lambda item: item[0]):
        data = token if isinstance(token, bytes) else str(token).encode("utf-8", "surrogatepass")
        h.update(f"{i}\0{len(data)}\0".encode() + data)
    return h.hexdigest()
