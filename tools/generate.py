#!/usr/bin/env python
"""Continue a prompt with a trained model: one process, from any checkpoint layout and ZeRO stage.

    python tools/generate.py --load checkpoints/gpt_moe_small --prompt "def main(" --max-new-tokens 64
    python tools/generate.py --load model.pt --prompt "import " --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1

--load is a --save directory (its latest checkpoint), one iter_N folder, or a file that
tools/consolidate_checkpoint.py wrote. The model and tokenizer are rebuilt from the configs the run
stored, so no model flag is re-typed (tokenizer files that moved: --vocab-file/--merge-file/
--tokenizer-model; --tokenizer-type where the run recorded none). A QAT run's weights are fake-quantized
as its next forward would have been, at the bits its schedule had reached. Prints the prompt and
its continuation; generation stops early at the end-of-document token.
"""

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from moezero.checkpoint import CheckpointError  # noqa: E402
from moezero.compression.inference import load_checkpoint_weights  # noqa: E402
from moezero.compression.source import load_checkpoint_model  # noqa: E402
from moezero.config import ConfigError, DataConfig, run_tokenizer_fields  # noqa: E402
from moezero.data import DataError, build_tokenizer  # noqa: E402
from moezero.models import generate  # noqa: E402
from moezero.training.args import ArgumentParser  # noqa: E402

_TOKENIZER_TYPES = next(f for f in dataclasses.fields(DataConfig) if f.name == "tokenizer_type").metadata["choices"]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--load", required=True, help="--save directory, iter_N folder or consolidated .pt file")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default: 0, off)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the smallest set of tokens with this much probability (default: 1.0, off)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (default: 1234)")
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        parser.add_argument(flag, default=None, help="the tokenizer file, where it moved since training")
    parser.add_argument(
        "--tokenizer-type",
        default=None,
        choices=_TOKENIZER_TYPES,
        help="the tokenizer (default: the run's; another type takes none of the run's tokenizer files)",
    )
    return parser


def tokenizer_config(configs, args) -> DataConfig:
    """The run's tokenizer settings (every field that decides it: a TikTokenizer's special tokens, a
    NullTokenizer's size), with the files and type the command line gives instead."""
    typed = {
        k: getattr(args, k)
        for k in ("vocab_file", "merge_file", "tokenizer_model", "tokenizer_type")
        if getattr(args, k)
    }
    return DataConfig(**run_tokenizer_fields(configs.get("data") or {}, typed))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0 or not 0 <= args.top_p <= 1:
        parser.error("--max-new-tokens, --temperature and --top-k must be >= 0, --top-p in [0, 1]")
    try:
        source = load_checkpoint_model(args.load)
        tokenizer = build_tokenizer(tokenizer_config(source.configs, args))
        model = load_checkpoint_weights(source, fake_quant=source.qat_forward())  # where its schedule stood
        prompt = tokenizer.tokenize(args.prompt) or [tokenizer.eod]
        vocab = model.config.vocab_size
        if max(prompt) >= vocab:
            raise ValueError(
                f"--prompt: token id {max(prompt)} is outside the model's vocabulary ({vocab}): the "
                f"tokenizer ({tokenizer_config(source.configs, args).tokenizer_type}) is not the run's; "
                "give its --tokenizer-type / --tokenizer-model / --vocab-file"
            )
        new = generate(
            model,
            prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.top_p,
            torch.Generator().manual_seed(args.seed),
            vocab_size=tokenizer.vocab_size,
            stop_token=tokenizer.eod,
        )
    except (CheckpointError, ConfigError, DataError, ValueError) as exc:
        parser.error(str(exc))
    print(args.prompt + tokenizer.detokenize(new), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
