#!/usr/bin/env python
"""Hugging Face model directories to moezero checkpoints and back.

    python tools/hf_checkpoint.py import HF_DIR CKPT_DIR
    python tools/hf_checkpoint.py export CKPT_DIR HF_DIR [--iteration N] [--dtype bfloat16] [--family F]
                                                          [--hf-config ORIGINAL_HF_DIR] [--overwrite]
                                                          [--max-shard-size 5GB] [--qat-masters]

import writes iteration 0 of CKPT_DIR from the Hub directory (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3,
Kimi-K2): the weights and the model's configs, so `--load CKPT_DIR --use-checkpoint-args --finetune` continues
it on any dp/ep/ZeRO stage with no model flag typed; with a tokenizer in HF_DIR (tokenizer.json, tokenizer.model or
Kimi's tiktoken.model) the checkpoint names it (--tokenizer-type HuggingFaceTokenizer --tokenizer-model HF_DIR).
A folder whose files do not hold its config's model, whose index names a missing shard, whose tokenizer cannot be
read or whose config names a dtype no Hub folder is written in is refused in one line before anything is written.
export writes the Hub directory of any
checkpoint's fp32 master weights (default dtype: an imported model's source dtype, else the run's), as the
family that holds the model; a checkpoint from import keeps its source config's other fields (token ids),
--hf-config gives them for any other. Both read and write a piece at a time: the peak memory is about one Hub
shard file plus one piece (docs: the HF memory benchmark), whatever the model's size.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

from moezero import checkpoint
from moezero.checkpoint import CheckpointError
from moezero.compression.inference import load_checkpoint_weights
from moezero.compression.source import load_checkpoint_model
from moezero.config import ConfigError
from moezero.hf import CheckpointMismatch, UnsupportedModel, save_pretrained
from moezero.hf.checkpoint_conversion import export_checkpoint, export_sources, exported_vocab_size, import_hub
from moezero.hf.load import hub_dtype
from moezero.training.args import ArgumentParser

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def shard_bytes(size: str) -> int:
    """transformers' max_shard_size spelling: "5GB", "500MB", or bytes."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10}
    text = size.strip().upper()
    unit = next((u for u in sorted(units, key=len, reverse=True) if text.endswith(u)), None)
    try:
        value = int(float(text[: -len(unit)]) * units[unit]) if unit else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{size!r} is not a size such as 5GB or 500MB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{size!r}: a shard holds at least one byte")
    return value


def _refuse_qat_masters(ckpt: str, qat_bits) -> None:
    """A QAT run's checkpoint holds fp32 masters, not the quantized weights its forward used: exported as they
    are only when asked (transformers would run another model than the one trained)."""
    if qat_bits:
        raise ConfigError(
            f"{ckpt}: trained with QAT (--qat-weight-bits {qat_bits}): its weights are the fp32 "
            "masters, not the quantized ones the run's forward used; pass --qat-masters to export "
            "them as they are, or write the quantized model with tools/export_quantized.py"
        )


def export(
    ckpt: str,
    hf_dir: str,
    dtype_name,
    family,
    hf_config,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 10**9,
    qat_masters: bool = False,
) -> None:
    base, base_generation = None, None
    if hf_config:
        with open(os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config) as f:
            base = json.load(f)
        generation = os.path.join(hf_config, "generation_config.json")
        if os.path.isdir(hf_config) and os.path.isfile(generation):
            with open(generation) as f:
                base_generation = json.load(f)
    dtype = DTYPES[dtype_name] if dtype_name else None
    if not os.path.isfile(ckpt):  # a checkpoint folder: read a piece at a time
        if not qat_masters:
            configs = checkpoint.read_train_state(checkpoint.resolve_checkpoint(ckpt)).get("configs") or {}
            _refuse_qat_masters(ckpt, (configs.get("qat") or {}).get("weight_bits"))
        export_checkpoint(
            ckpt,
            hf_dir,
            dtype=dtype,
            family=family,
            hub_config=base,
            overwrite=overwrite,
            max_shard_bytes=max_shard_bytes,
            generation_config=base_generation,
            report=print,
        )
        return
    source = load_checkpoint_model(ckpt)  # a consolidated file holds the whole model anyway
    if not qat_masters:
        _refuse_qat_masters(ckpt, source.qat.weight_bits if source.qat is not None else None)
    imported = source.configs.get("hf")
    dtype = dtype or (hub_dtype(imported) if imported else DTYPES[source.description.dtype])
    fp32 = dataclasses.replace(source.description, dtype="float32")  # the masters as they are
    model = load_checkpoint_weights(dataclasses.replace(source, description=fp32))
    model.hub_config, model.hub_generation_config, token_ids, tokenizer = export_sources(
        source.configs, base, base_generation
    )
    save_pretrained(
        model,
        hf_dir,
        family=family,
        dtype=dtype,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
        token_ids=token_ids,
        tokenizer_files=tokenizer,
        vocab_size=exported_vocab_size(source.configs, model.config.vocab_size, print),
    )


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="a Hub directory -> iteration 0 of a moezero checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("ckpt_dir")
    exp = commands.add_parser("export", help="a moezero checkpoint -> a Hub directory")
    exp.add_argument("ckpt_dir", help="a --save directory (its latest), an iter_N folder or a consolidated file")
    exp.add_argument("hf_dir")
    exp.add_argument("--iteration", type=int, default=None, help="default: the latest")
    exp.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="default: the Hugging Face source's dtype "
        "for a checkpoint that came from an import, else the params' dtype of the run",
    )
    exp.add_argument("--family", default=None, help="the Hub family to write (default: the one that holds the model)")
    exp.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the weights HF_DIR holds (by default a "
        "folder with weights is refused: transformers could load those instead)",
    )
    exp.add_argument(
        "--max-shard-size",
        type=shard_bytes,
        default="5GB",
        help="the largest file written (transformers' "
        "max_shard_size: 5GB, 500MB, ...); export holds about one such file in memory",
    )
    exp.add_argument(
        "--hf-config",
        default=None,
        help="a Hub config.json (or its folder, then its "
        "generation_config.json too) whose other fields (token ids) the export keeps; it must describe "
        "this model (another model's sliding window, ... is refused)",
    )
    exp.add_argument(
        "--qat-masters",
        action="store_true",
        help="a QAT run's checkpoint: write its fp32 master "
        "weights as they are (not the quantized weights its forward used; refused without this)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            print(f"wrote {import_hub(args.hf_dir, args.ckpt_dir)}")
            return 0
        ckpt = args.ckpt_dir if args.iteration is None else checkpoint.iteration_dir(args.ckpt_dir, args.iteration)
        export(
            ckpt,
            args.hf_dir,
            args.dtype,
            args.family,
            args.hf_config,
            args.overwrite,
            args.max_shard_size,
            args.qat_masters,
        )
        print(f"wrote {args.hf_dir}")
    except (
        CheckpointError,
        CheckpointMismatch,
        UnsupportedModel,
        ConfigError,
        FileNotFoundError,
        FileExistsError,
        KeyError,
    ) as exc:
        parser.error(str(exc).strip("'\""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
