"""Kimi-K2's tokenizer: a `tiktoken.model` file (tiktoken's own format: one "base64-token rank" line per token) with
the split pattern and special tokens of the folder's tokenization_kimi.TikTokenTokenizer, built here from the files
without running that code.

The ranks are ids 0..n-1; the next 256 ids are special tokens, named by tokenizer_config.json's
added_tokens_decoder (the others "<|reserved_token_{id}|>"), and any id it names beyond them is one too. bos/eos are
its bos_token / eos_token ([BOS] / [EOS] by default). Special tokens written in a text are encoded as themselves,
as transformers' tokenizers match added tokens. Needs the `tiktoken` package (an optional extra).
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Dict, Iterable, List, Tuple

from moezero.data.errors import DataError

# TikTokenTokenizer.pat_str of Kimi-K2's tokenization_kimi.py: Han runs, then cl100k-like pieces that exclude Han
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def is_kimi_config(config: Dict) -> bool:
    """Whether a tokenizer_config.json names Kimi's TikTokenTokenizer (its class, or its auto_map entry)."""
    auto = (config.get("auto_map") or {}).get("AutoTokenizer") if isinstance(config.get("auto_map"), dict) else None
    names = [config.get("tokenizer_class")] + (list(auto) if isinstance(auto, (list, tuple)) else [auto])
    return any(isinstance(n, str) and (n == "TikTokenTokenizer" or n.startswith("tokenization_kimi.")) for n in names)


class KimiTiktoken:
    def __init__(self, file: str, config: Dict, flag: str):
        if not is_kimi_config(config):
            raise DataError(
                f"{flag}: {file} is a tiktoken model whose split pattern moezero does not know: it reads "
                "Kimi-K2's (a tokenizer_config.json beside it naming tokenization_kimi.TikTokenTokenizer)"
            )
        try:
            import tiktoken
        except ImportError:
            raise DataError(
                f"{flag}: {file} is a tiktoken model, which needs the `tiktoken` package (pip install tiktoken)"
            ) from None
        ranks = read_tiktoken_ranks(file, flag)
        self.special_tokens = _special_tokens(len(ranks), config.get("added_tokens_decoder") or {}, file, flag)
        self._ranks = ranks
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(file), pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.vocab_size = max(self.special_tokens.values()) + 1

    def encode(self, text: str) -> List[int]:
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: List[int]) -> str:
        return self._encoding.decode(ids)

    def vocab_items(self) -> Iterable[Tuple[int, object]]:
        yield from ((i, token) for token, i in self._ranks.items())
        yield from ((i, token) for token, i in self.special_tokens.items())


def read_tiktoken_ranks(path: str, flag: str) -> Dict[bytes, int]:
    """{token bytes: rank} of a tiktoken.model file; its ranks must be 0..n-1, each token once."""
    ranks: Dict[bytes, int] = {}
    lineno = 0
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (OSError, ValueError, binascii.Error) as exc:
        raise DataError(
            f"{flag}: {path} is not a tiktoken model (lines of 'base64-token rank'): line {lineno}: {str(exc)[:160]}"
        ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{flag}: {path}: its ranks are not 0..{len(ranks) - 1}, each token once")
    return ranks


def _special_tokens(num_base: int, added: Dict, file: str, flag: str) -> Dict[str, int]:
    named = {}
    for key, token in added.items():
        content = token.get("content") if isinstance(token, dict) else token
        if not (str(key).isdigit() and isinstance(content, str)):
            raise DataError(
                f"{flag}: the tokenizer_config.json beside {file} has an added_tokens_decoder entry "
                f"{key!r} that is not an id with its content"
            )
        named[int(key)] = content
    if any(i < num_base for i in named):
        raise DataError(
            f"{flag}: the tokenizer_config.json beside {file} names special tokens among the "
            f"{num_base} ranks of the file (another tokenizer's config?)"
        )
    ids = sorted(set(range(num_base, num_base + NUM_RESERVED_SPECIAL_TOKENS)) | set(named))
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
