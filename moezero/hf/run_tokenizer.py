"""The run's tokenizer in a Hub folder: config.json's token ids of a model trained from scratch (its run's
tokenizer's, never the family's defaults) and the tokenizer files an export carries.

A Hub config that omits bos/eos/pad takes its config class's defaults (Mixtral's eos 2, OLMoE's 50279), which
name other tokens than the run's: transformers' generate would not stop at the run's end of document. A folder
without the run's tokenizer files gives AutoTokenizer an empty tokenizer (it encodes 'hello world' as []).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Optional, Union

from moezero.config import ConfigError, DataConfig, run_tokenizer_fields
from moezero.data.errors import DataError
from moezero.data.tokenizer import build_tokenizer

TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
NO_TOKEN_IDS: Dict[str, Optional[int]] = dict.fromkeys(TOKEN_ID_FIELDS)
# what AutoTokenizer reads from a Hub folder
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.jinja",
    "chat_template.json",
)


def tokenizer_token_ids(tokenizer) -> Dict[str, Optional[int]]:
    """eos: the end-of-document token the run's documents end with; bos: the token the tokenizer starts each
    document with (None where it adds none, as Megatron's GPT-2 BPE); no pad (the run's data holds none)."""
    bos = tokenizer.bos if getattr(tokenizer, "adds_bos", False) and tokenizer.bos >= 0 else None
    return {"bos_token_id": bos, "eos_token_id": int(tokenizer.eod), "pad_token_id": None}


def run_token_ids(data_section: Dict[str, Any], quiet: bool = False) -> Dict[str, Optional[int]]:
    """The token ids of a checkpoint's run from its stored data section (its tokenizer, built from its files);
    null ids, with a warning unless `quiet`, where the tokenizer cannot be built here (its files moved)."""
    try:
        tokenizer = build_tokenizer(DataConfig(**run_tokenizer_fields(data_section or {}, {})))
    except (ConfigError, DataError, OSError) as exc:
        if quiet:
            return dict(NO_TOKEN_IDS)
        warnings.warn(
            f"the run's tokenizer cannot be built here ({str(exc).splitlines()[0]}): the export names no "
            "bos/eos token; pass --hf-config with a config.json that gives them"
        )
        return dict(NO_TOKEN_IDS)
    return tokenizer_token_ids(tokenizer)


def run_tokenizer_files(data_section: Dict[str, Any]) -> Dict[str, Union[str, bytes]]:
    """{name in the Hub folder: path, or the bytes to write} of a run's tokenizer: a Hugging Face tokenizer's
    (--tokenizer-type HuggingFaceTokenizer, an import's) files of its folder AutoTokenizer reads, or its
    tokenizer.json file; the byte-level tokenizer's as a tokenizer.json (byte b is id b, the end of document 256);
    GPT-2 BPE's vocab.json and merges.txt. None for a data section that names no tokenizer (an import of a folder
    without one); none with a warning for the tokenizers transformers has no spelling of, or whose files are not
    here."""
    data = data_section or {}
    kind, path = data.get("tokenizer_type"), data.get("tokenizer_model")
    if kind == "ByteLevelTokenizer":
        return byte_level_hub_files()
    if kind == "GPT2BPETokenizer":
        return _gpt2_bpe_files(data.get("vocab_file"), data.get("merge_file"))
    if kind is None:
        return {}
    if kind != "HuggingFaceTokenizer" or not path:
        warnings.warn(
            f"the run's tokenizer ({kind}) has no Hugging Face spelling moezero writes: the folder holds "
            "no tokenizer; copy in one that gives the run's token ids"
        )
        return {}
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    # a tokenizer.json file's folder holds what declares its special tokens (the run read its eos there too)
    found = {name: os.path.join(folder, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))}
    if os.path.isfile(path):
        found["tokenizer.json"] = path
    if not found:
        warnings.warn(f"the run's tokenizer ({path}) is not here: the export holds no tokenizer files")
    return found


def byte_level_hub_files() -> Dict[str, bytes]:
    """The byte-level tokenizer as a Hub tokenizer: a BPE of the 256 bytes (GPT-2's byte-to-character map) with no
    merges, so AutoTokenizer encodes text as its UTF-8 bytes, and <|endoftext|> (id 256) its end of document."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BYTE_LEVEL_EOD])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": BYTE_LEVEL_EOD}
    return {"tokenizer.json": tokenizer.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()}


BYTE_LEVEL_EOD = "<|endoftext|>"


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the ByteLevel pre-tokenizer's)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _gpt2_bpe_files(vocab_file: Optional[str], merge_file: Optional[str]) -> Dict[str, Union[str, bytes]]:
    if not (vocab_file and merge_file and os.path.isfile(vocab_file) and os.path.isfile(merge_file)):
        warnings.warn(
            f"the run's GPT-2 BPE files ({vocab_file}, {merge_file}) are not here: the export holds no tokenizer files"
        )
        return {}
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "add_prefix_space": False,
    }
    return {"vocab.json": vocab_file, "merges.txt": merge_file, "tokenizer_config.json": json.dumps(config).encode()}
