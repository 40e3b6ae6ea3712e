"""The default corpus: the Python standard library's own `.py` sources, tokenized once into a cache.

Every machine that runs moezero has these files, so a run with no `--data-path` trains on real
text with nothing to download. The file list is sorted and capped, hence deterministic for a given
Python installation; each file is one document ending with the EOD token. Its tokenizer is recorded beside it
(tokenizer_record), as tools/preprocess_data.py records its output's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
from typing import Callable, List, TypeVar

import numpy as np

from moezero.data.errors import DataError
from moezero.data.indexed import check_indexed_dataset, write_indexed_dataset

logger = logging.getLogger(__name__)

# Directories that are not representative source text: tests, third-party packages, codec
# tables and the generated pydoc topics.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "encodings",
        "pydoc_data",
        "ensurepip",
    }
)
_NAME = "stdlib_text_document"
_LAYOUT = "with tokenizer record"  # in the cache key: a cache from before the records is built anew, with one
T = TypeVar("T")


def default_cache_dir(data_cache_path: str | None) -> str:
    """`--data-cache-path`, else ~/.cache/moezero."""
    return os.path.abspath(os.path.expanduser(data_cache_path or os.path.join("~", ".cache", "moezero")))


def stdlib_source_files(max_files: int, root: str | None = None) -> List[str]:
    """The first `max_files` `.py` files under the stdlib directory, as sorted relative paths."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        rel = os.path.relpath(dirpath, root)
        found += [os.path.normpath(os.path.join(rel, f)).replace(os.sep, "/") for f in filenames if f.endswith(".py")]
    if not found:
        raise DataError(
            f"--data-path not given and no Python sources found under {root} for the default corpus; pass --data-path"
        )
    return sorted(found)[:max_files]


def _corpus_key(root: str, files: List[str], tokenizer) -> str:
    """A hash of everything the tokens depend on: the tokenizer (with the contents of its files: one rewritten at
    the same path tokenizes differently) and each source file's path, size and mtime."""
    identifiers = dict(tokenizer.unique_identifiers)
    h = hashlib.sha256(f"{_LAYOUT}\0{identifiers!r}".encode())
    for key in TOKENIZER_PATH_KEYS:
        for path in _tokenizer_files(identifiers.get(key)):
            h.update(_file_fingerprint(path))
    for rel in files:
        st = os.stat(os.path.join(root, rel))
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


TOKENIZER_PATH_KEYS = ("path", "vocab_file", "merge_file")  # the tokenizers' unique_identifiers naming files
# what a tokenizer reads from a folder (a Hugging Face one): its weights and README beside it do not count
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)


def _tokenizer_files(value) -> List[str]:
    """The files a tokenizer identifier names: the file, or a folder's tokenizer files."""
    if not isinstance(value, str) or not os.path.exists(value):
        return []
    if os.path.isfile(value):
        return [value]
    return [os.path.join(value, name) for name in TOKENIZER_FILE_NAMES if os.path.isfile(os.path.join(value, name))]


def _file_fingerprint(path: str, read_limit: int = 64 << 20) -> bytes:
    """The file's contents' hash (by size and mtime where it is too large or cannot be read)."""
    try:
        st = os.stat(path)
        if st.st_size <= read_limit:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).digest()
        return f"{st.st_size}\0{st.st_mtime_ns}".encode()
    except OSError as error:  # unreadable or gone: the tokenizer itself reports what it needs
        return f"{path}: {error.strerror}".encode()


def _tokenize_file(path: str, tokenizer) -> np.ndarray:
    with open(path, "rb") as f:
        data = f.read()
    if hasattr(tokenizer, "tokenize_bytes"):
        ids = np.frombuffer(data, dtype=np.uint8)  # byte-level: the bytes are the ids
    else:
        ids = np.asarray(tokenizer.tokenize(data.decode("utf-8", errors="replace")), dtype=np.int64)
    return np.append(ids.astype(np.int64), tokenizer.eod)


def build_default_corpus(cache_dir: str, max_files: int, tokenizer, root: str | None = None) -> str:
    """Tokenize the stdlib sources into `cache_dir` unless already there; return the dataset prefix.

    Built in a private temporary directory that is renamed into place (atomic), under a file
    lock, so concurrent processes neither duplicate the work nor read a half-written corpus.
    """
    from filelock import FileLock  # a torch dependency, so always installed

    root = root or sysconfig.get_paths()["stdlib"]
    files = stdlib_source_files(max_files, root)
    name = f"stdlib-{_corpus_key(root, files, tokenizer)}"
    corpus_dir = os.path.join(cache_dir, "corpus")
    final = os.path.join(corpus_dir, name)
    os.makedirs(corpus_dir, exist_ok=True)
    prefix = os.path.join(final, _NAME)
    with FileLock(final + ".lock"):
        if os.path.isdir(final) and not _is_intact(prefix):
            logger.warning("default corpus cache %s is damaged; rebuilding it", final)
            shutil.rmtree(final)
        if not os.path.isdir(final):
            _build_into(final, root, files, tokenizer)
    check_indexed_dataset(prefix, flag="--data-cache-path (default corpus)")
    return prefix


def _is_intact(prefix: str) -> bool:
    try:
        check_indexed_dataset(prefix)
        return True
    except DataError:
        return False


def _build_into(final: str, root: str, files: List[str], tokenizer) -> None:
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        docs = (_tokenize_file(os.path.join(root, rel), tokenizer) for rel in files)
        summary = write_indexed_dataset(os.path.join(tmp, _NAME), docs, tokenizer.vocab_size, tokenizer)
        with open(os.path.join(tmp, "files.txt"), "w") as f:
            f.write("".join(f"{rel}\n" for rel in files))
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("default corpus: %d stdlib files, %d tokens, cached in %s", len(files), summary.num_tokens, final)


def rank0_first(fn: Callable[[], T], enabled: bool = True) -> T:
    """Run `fn` on rank 0 first while the other ranks wait at a barrier, then on them.

    Without an initialised torch.distributed (or with enabled=False) just runs `fn`. Rank 0 reaches
    the barrier even when `fn` fails, so the others never hang; they then run `fn` themselves and
    report the same error.
    """
    import torch.distributed as dist

    if not (enabled and dist.is_available() and dist.is_initialized()):
        return fn()
    if dist.get_rank() != 0:
        dist.barrier()
        return fn()
    try:
        return fn()
    finally:
        dist.barrier()


def default_corpus_prefix(data_config, tokenizer, rank0_builds_first: bool = True) -> str:
    """The default corpus prefix for a `DataConfig` with no data_path, built on first use."""
    cache_dir = default_cache_dir(data_config.data_cache_path)
    return rank0_first(
        lambda: build_default_corpus(cache_dir, data_config.default_corpus_max_files, tokenizer), rank0_builds_first
    )
