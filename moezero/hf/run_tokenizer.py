"""The run's tokenizer in a Hub folder: config.json's token ids of a model trained from scratch (its run's
tokenizer's, never the family's defaults) and the tokenizer files an export carries.

A Hub config that omits bos/eos/pad takes its config class's defaults (Mixtral's eos 2, OLMoE's 50279), which
name other tokens than the run's: transformers' generate would not stop at the run's end of document. A folder
without the run's tokenizer files gives AutoTokenizer an empty tokenizer (it encodes 'hello world' as []).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Dict, Optional

from moezero.config import ConfigError, DataConfig, run_tokenizer_fields
from moezero.data.errors import DataError
from moezero.data.tokenizer import build_tokenizer

TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
NO_TOKEN_IDS: Dict[str, Optional[int]] = dict.fromkeys(TOKEN_ID_FIELDS)
# what AutoTokenizer reads from a Hub folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")


def tokenizer_token_ids(tokenizer) -> Dict[str, Optional[int]]:
    """eos: the end-of-document token the run's documents end with; bos: the token the tokenizer starts each
    document with (None where it adds none, as Megatron's GPT-2 BPE); no pad (the run's data holds none)."""
    bos = tokenizer.bos if getattr(tokenizer, "adds_bos", False) and tokenizer.bos >= 0 else None
    return {"bos_token_id": bos, "eos_token_id": int(tokenizer.eod), "pad_token_id": None}


def run_token_ids(data_section: Dict[str, Any]) -> Dict[str, Optional[int]]:
    """The token ids of a checkpoint's run from its stored data section (its tokenizer, built from its files);
    null ids, with a warning, where the tokenizer cannot be built here (its files moved)."""
    try:
        tokenizer = build_tokenizer(DataConfig(**run_tokenizer_fields(data_section or {}, {})))
    except (ConfigError, DataError, OSError) as exc:
        warnings.warn(f"the run's tokenizer cannot be built here ({str(exc).splitlines()[0]}): the export names no "
                      "bos/eos token; pass --hf-config with a config.json that gives them")
        return dict(NO_TOKEN_IDS)
    return tokenizer_token_ids(tokenizer)


def run_tokenizer_files(data_section: Dict[str, Any]) -> Dict[str, str]:
    """{name in the Hub folder: path} of a run's Hugging Face tokenizer (--tokenizer-type HuggingFaceTokenizer, an
    import's): the files of its folder AutoTokenizer reads, or its tokenizer.json file. None for other tokenizers
    (no Hub spelling), and none with a warning where its files are not here."""
    data = data_section or {}
    path = data.get("tokenizer_model")
    if data.get("tokenizer_type") != "HuggingFaceTokenizer" or not path:
        return {}
    folder = os.path.dirname(path) if os.path.isfile(path) else path
    # a tokenizer.json file's folder holds what declares its special tokens (the run read its eos there too)
    found = {name: os.path.join(folder, name) for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))}
    if os.path.isfile(path):
        found["tokenizer.json"] = path
    if not found:
        warnings.warn(f"the run's tokenizer ({path}) is not here: the export holds no tokenizer files")
    return found
