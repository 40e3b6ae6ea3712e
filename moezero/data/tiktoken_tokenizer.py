"""Megatron's TikTokenizer: a tiktoken BPE from megatron-core's JSON vocabulary, as its TikTokenTokenizer builds it.

The vocabulary file is a JSON list of {"rank", "token_bytes" (base64), "token_str"}, rank i at position i, the
first 256 the single bytes. Ids 0..num_special_tokens-1 are special tokens ("<unk>", "<s>", "</s>", "<mask>",
"<pad>", "<cls>", "<sep>", then "<SPECIAL_i>" fillers); the vocabulary's ranks follow, cut to
vocab_size - num_special_tokens entries. "</s>" (id 2) ends a document; special tokens written in the text are
encoded as themselves (Megatron's allowed_special="all"). Needs the `tiktoken` package (an optional extra).
"""

from __future__ import annotations

import base64
import json
import os
from collections import OrderedDict
from typing import Dict, Iterable, List

from moezero.data.errors import DataError

PATTERNS = {  # megatron-core's --tiktoken-pattern choices
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2**17


class TikTokenizer:
    def __init__(
        self, vocab_file: str, pattern: str = "v2", num_special_tokens: int = 1000, vocab_size: int = DEFAULT_VOCAB_SIZE
    ):
        if not (len(SPECIAL_TOKENS) <= num_special_tokens < vocab_size):
            raise DataError(
                f"--tiktoken-num-special-tokens={num_special_tokens}: must be at least "
                f"{len(SPECIAL_TOKENS)} and below the vocabulary size ({vocab_size}, --vocab-size)"
            )
        try:
            import tiktoken
        except ImportError:
            raise DataError(
                "--tokenizer-type=TikTokenizer needs the `tiktoken` package (pip install tiktoken)"
            ) from None
        specials = list(SPECIAL_TOKENS) + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), num_special_tokens)]
        ranks = _read_ranks(vocab_file, vocab_size - num_special_tokens, num_special_tokens)
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(vocab_file))),
            pat_str=PATTERNS[pattern],
            mergeable_ranks=ranks,
            special_tokens={t: i for i, t in enumerate(specials)},
        )
        self.vocab_size, self.bos, self.eod = vocab_size, SPECIAL_TOKENS.index("<s>"), SPECIAL_TOKENS.index("</s>")
        self.unique_identifiers = OrderedDict(
            cls=type(self).__name__,
            path=os.path.abspath(vocab_file),
            pattern=pattern,
            num_special_tokens=num_special_tokens,
            vocab_size=vocab_size,
        )

    def tokenize(self, text: str) -> List[int]:
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])

    def vocab_items(self):
        return [(i, self._encoding.decode_single_token_bytes(i)) for i in range(self._encoding.n_vocab)]


def _read_ranks(path: str, keep: int, offset: int) -> Dict[bytes, int]:
    """{token bytes: id} of the first `keep` entries of a megatron-core tiktoken vocabulary (ids from `offset`)."""
    flag = f"--tokenizer-model={path!r}"
    if not os.path.isfile(path):
        raise DataError(f"{flag}: no such file (a tiktoken vocabulary, .json)")
    try:
        with open(path) as f:
            vocab = json.load(f)
        entries = [(e["rank"], base64.b64decode(e["token_bytes"], validate=True)) for e in vocab]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise DataError(
            f"{flag}: not a tiktoken vocabulary (a JSON list of rank / token_bytes / token_str): {str(exc)[:200]}"
        ) from None
    if keep < 256:
        raise DataError(
            f"--vocab-size: leaves {keep} tokens after --tiktoken-num-special-tokens; a byte-level "
            "vocabulary needs at least the 256 single bytes"
        )
    if len(entries) < keep:
        raise DataError(
            f"{flag}: holds {len(entries)} tokens, fewer than --vocab-size minus --tiktoken-num-special-tokens ({keep})"
        )
    ranks: Dict[bytes, int] = {}
    for i, (rank, token) in enumerate(entries[:keep]):
        if rank != i or (i < 256 and token != bytes([i])) or token in ranks:
            raise DataError(
                f"{flag}: entry {i} is not rank {i} of a byte-level vocabulary (the first 256 are the "
                "single bytes, each token once)"
            )
        ranks[token] = i + offset
    return ranks
