"""Which tokenizer wrote a dataset: a record beside its .bin/.idx, checked against the run's tokenizer.

Token ids mean nothing without the vocabulary that made them: data preprocessed with one tokenizer and trained
with another (a --load-hf folder's, another --tokenizer-model) trains on ids that name other tokens, and nothing
fails. `tools/preprocess_data.py` and the default corpus write `<prefix>.tokenizer-record.json`: the tokenizer's
type and source, its size and end-of-document id, a sha256 of its vocabulary (every id and its token), and the
.idx it describes (size, and a sha256 of its first and last MiB: a record left beside files rewritten since is
seen as such). A run refuses data whose vocabulary hash differs from its tokenizer's, naming both; data with no
record (Megatron's tools, older files) or a record of other files is accepted with one notice.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Dict

from moezero.data.errors import DataError
from moezero.data.hub_tokenizer import vocab_digest

SUFFIX = ".tokenizer-record.json"
_ENDS = 1 << 20


def record_path(prefix: str) -> str:
    return prefix + SUFFIX


def tokenizer_identity(tokenizer) -> Dict[str, object]:
    """The type, source, size, end-of-document id and vocabulary hash of a tokenizer (cached on it)."""
    cached = getattr(tokenizer, "_moezero_identity", None)
    if cached is None:
        ids = dict(getattr(tokenizer, "unique_identifiers", {}))
        source = ids.get("path") or ids.get("vocab_file")
        cached = {
            "type": type(tokenizer).__name__,
            "source": source,
            "vocab_size": int(tokenizer.vocab_size),
            "eod": int(tokenizer.eod),
            "vocab_sha256": vocab_digest(tokenizer.vocab_items()),
        }
        tokenizer._moezero_identity = cached
    return cached


def describe(identity: Dict[str, object]) -> str:
    source = f" {identity['source']}" if identity.get("source") else ""
    return (
        f"{identity.get('type')}{source} ({identity.get('vocab_size')} ids, vocabulary sha256 "
        f"{str(identity.get('vocab_sha256'))[:12]})"
    )


def write_record(prefix: str, tokenizer) -> None:
    """Write the record of `prefix` (its .idx written already), atomically."""
    record = dict(tokenizer_identity(tokenizer), idx=_idx_fingerprint(prefix + ".idx"))
    tmp = f"{record_path(prefix)}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, record_path(prefix))


def remove_record(prefix: str) -> None:
    """Before the files of `prefix` are replaced: a record of the old ones would describe the new."""
    try:
        os.remove(record_path(prefix))
    except FileNotFoundError:
        pass


def check_record(prefix: str, tokenizer, report: Callable[[str], None], flag: str = "--data-path") -> None:
    """DataError where `prefix` was tokenized with another vocabulary than `tokenizer`'s; `report` a notice where
    nothing says which (no record, or one of other files)."""
    path = record_path(prefix)
    run = tokenizer_identity(tokenizer)
    if not os.path.exists(path):
        report(
            f"{flag}: {prefix} has no tokenizer record ({os.path.basename(path)}: Megatron's tools and older "
            f"files write none): its token ids are taken to be those of the run's tokenizer, {describe(run)}"
        )
        return
    try:
        with open(path) as f:
            record = json.load(f)
        written, idx = record["vocab_sha256"], record["idx"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"{flag}: {path} is not a tokenizer record ({str(exc)[:120]}); delete it to train on "
            f"{prefix} unchecked, or preprocess it again"
        ) from None
    if idx != _idx_fingerprint(prefix + ".idx"):
        report(
            f"{flag}: the tokenizer record {path} describes other files than {prefix}.idx (rewritten since, by "
            f"another tool?): ignored; its token ids are taken to be those of the run's tokenizer, {describe(run)}"
        )
        return
    if written != run["vocab_sha256"]:
        raise DataError(
            f"{flag}: {prefix} was tokenized with {describe(record)} ({path}), but the run's tokenizer is "
            f"{describe(run)}: its token ids would name other tokens. Train with the data's tokenizer "
            "(--tokenizer-type / --tokenizer-model), or preprocess the data with the run's "
            "(tools/preprocess_data.py)"
        )


def _idx_fingerprint(path: str) -> Dict[str, object]:
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_ENDS))
        if size > 2 * _ENDS:
            f.seek(size - _ENDS)
        h.update(f.read())
    return {"bytes": size, "ends_sha256": h.hexdigest()}
