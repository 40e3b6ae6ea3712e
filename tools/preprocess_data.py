#!/usr/bin/env python
"""Turn jsonl or plain-text files into Megatron indexed datasets (.bin + .idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my --json-keys text \\
        --append-eod --workers 4
    -> data/my_text_document.bin, data/my_text_document.idx   (train with --data-path data/my_text_document)

A `.jsonl`/`.json` input holds one JSON object per line, each key of --json-keys one document;
any other input file is one document (key "text"). Tokenizer: the built-in byte-level one, GPT-2's BPE
(--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt) or a local
HuggingFace tokenizer (--tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH: its tokenizer.json,
tokenizer.model or Kimi's tiktoken.model); train with the same tokenizer flags (to fine-tune a Hub model, its
folder's). Beside each dataset, <prefix>.tokenizer-record.json names the tokenizer: a run with another refuses it.
The output depends only on the inputs, their order and the tokenizer, not on --workers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from typing import Iterator, List, Tuple

import numpy as np

from moezero.config import TOKENIZER_FIELDS, ConfigError, DataConfig
from moezero.data import DataError, build_tokenizer
from moezero.data.indexed import stage_indexed_dataset
from moezero.training.args import ArgumentParser, add_config_arguments, configs_from_args


_worker_state = {}  # the tokenizer of a worker process, built once by _init_worker


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="jsonl or text files, read in the order given")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.{bin,idx}")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys to extract, one dataset each")
    p.add_argument(
        "--input-format",
        choices=("auto", "jsonl", "text"),
        default="auto",
        help="auto: .jsonl/.json are jsonl, anything else is one text document per file",
    )
    add_config_arguments(p, DataConfig, only=TOKENIZER_FIELDS)
    p.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    args = p.parse_args(argv)
    try:
        args.data = configs_from_args(args, [DataConfig])["data"]
    except ConfigError as exc:
        p.error(str(exc))
    return args


def _is_jsonl(path: str, fmt: str) -> bool:
    return fmt == "jsonl" or (fmt == "auto" and path.endswith((".jsonl", ".json")))


def read_texts(inputs: List[str], key: str, fmt: str) -> Iterator[str]:
    """The documents of one key, in input order."""
    for path in inputs:
        if not _is_jsonl(path, fmt):
            if key == "text":
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield f.read()
            continue
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(
                        f"--input {path}:{lineno}: not UTF-8 text (byte {exc.start + 1} of the line is "
                        f"{raw[exc.start : exc.start + 1]!r}); JSON lines are UTF-8"
                    ) from None
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)[key]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ConfigError(f"--input {path}:{lineno}: not a JSON object with key {key!r} ({exc})") from None


def _init_worker(data: DataConfig, append_eod: bool) -> None:
    _worker_state["tokenizer"], _worker_state["append_eod"] = build_tokenizer(data), append_eod


def _encode(text: str) -> np.ndarray:
    tok = _worker_state["tokenizer"]
    ids = tok.tokenize(text) + ([tok.eod] if _worker_state["append_eod"] else [])
    return np.asarray(ids, dtype=np.int64)


def encode_all(texts: Iterator[str], args: argparse.Namespace) -> Iterator[np.ndarray]:
    """Token arrays in input order (imap keeps the order whatever the worker count)."""
    init = (args.data, args.append_eod)
    if args.workers <= 1:
        _init_worker(*init)
        yield from map(_encode, texts)
        return
    with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=init) as pool:
        yield from pool.imap(_encode, texts, chunksize=16)


def preprocess(args: argparse.Namespace) -> List[Tuple[str, int, int]]:
    """Write one dataset per key, each with the record of its tokenizer; returns (prefix, documents, tokens) for
    each. Every key is written under temporary names first and put in place only once all are: a failure (a
    line without a later key) leaves no dataset of this run, and the old files of the prefixes as they were."""
    if args.workers < 1:
        raise ConfigError(f"--workers={args.workers}: must be >= 1")
    tokenizer = build_tokenizer(args.data)
    staged = []
    try:
        for key in args.json_keys:
            texts = read_texts(args.input, key, args.input_format)
            staged.append(
                stage_indexed_dataset(
                    f"{args.output_prefix}_{key}_document", encode_all(texts, args), tokenizer.vocab_size
                )
            )
    except BaseException:
        for dataset in staged:
            dataset.discard()
        raise
    written = []
    for dataset in staged:
        summary = dataset.publish(tokenizer)
        written.append((dataset.prefix, summary.num_documents, summary.num_tokens))
    return written


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        written = preprocess(args)
    except (ConfigError, DataError, OSError) as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        return 2
    for prefix, docs, tokens in written:
        print(f"{prefix}.{{bin,idx}}: {docs} documents, {tokens} tokens")
    print(f"done in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
