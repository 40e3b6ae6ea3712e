#!/usr/bin/env python
"""Hugging Face model directories to moezero checkpoints and back.

    python tools/hf_checkpoint.py import HF_DIR CKPT_DIR
    python tools/hf_checkpoint.py export CKPT_DIR HF_DIR [--iteration N] [--dtype bfloat16] [--family F]
                                                          [--hf-config ORIGINAL_HF_DIR] [--overwrite]

import writes iteration 0 of CKPT_DIR from the Hub directory (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3,
Kimi-K2): the weights and the model's configs, so `--load CKPT_DIR --use-checkpoint-args --finetune` continues
it on any dp/ep/ZeRO stage with no model flag typed; with a tokenizer.json in HF_DIR the checkpoint names it
(--tokenizer-type HuggingFaceTokenizer --tokenizer-model HF_DIR). export writes the Hub directory of any
checkpoint's fp32 master weights (default dtype: an imported model's source dtype, else the run's), as the
family that holds the model; a checkpoint from import keeps its source config's other fields (token ids),
--hf-config gives them for any other.
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
from moezero.config import ConfigError, MoEConfig
from moezero.hf import CheckpointMismatch, UnsupportedModel, from_pretrained, save_pretrained
from moezero.hf.files import HubDirectory
from moezero.hf.load import hub_configs, hub_dtype
from moezero.parallel import ParallelGroups
from moezero.training.args import ArgumentParser
from moezero.zero import ZeroOptimizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def import_directory(hf_dir: str, ckpt_dir: str) -> str:
    saved = checkpoint.saved_iterations(ckpt_dir)
    if saved or os.path.exists(os.path.join(ckpt_dir, checkpoint.POINTER)):
        raise CheckpointError(f"{ckpt_dir}: holds a run's checkpoints (iterations {', '.join(map(str, saved))}); "
                              "import into a new folder (the import is iteration 0 and would become latest)")
    hub = HubDirectory(hf_dir)
    gpt, moe = hub_configs(hub)
    model = from_pretrained(hf_dir, dtype=torch.float32)
    configs = {"model": dataclasses.asdict(gpt), "moe": dataclasses.asdict(moe or MoEConfig()), "hf": hub.config}
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        configs["data"] = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(hf_dir)}
    opt = ZeroOptimizer(model, torch.optim.AdamW, ParallelGroups.single(), stage=0)
    return checkpoint.save_checkpoint(ckpt_dir, 0, model, opt, configs, plugins={})


def export_checkpoint(ckpt: str, hf_dir: str, dtype_name, family, hf_config, overwrite: bool = False) -> None:
    source = load_checkpoint_model(ckpt)
    imported = source.configs.get("hf")
    dtype = DTYPES[dtype_name] if dtype_name else hub_dtype(imported) if imported else DTYPES[source.description.dtype]
    fp32 = dataclasses.replace(source.description, dtype="float32")   # the masters as they are
    model = load_checkpoint_weights(dataclasses.replace(source, description=fp32))
    base = source.configs.get("hf")
    if hf_config:
        with open(os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config) as f:
            base = json.load(f)
    model.hub_config = base
    save_pretrained(model, hf_dir, family=family, dtype=dtype, overwrite=overwrite)


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
    exp.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: the Hugging Face source's dtype "
                     "for a checkpoint that came from an import, else the params' dtype of the run")
    exp.add_argument("--family", default=None, help="the Hub family to write (default: the one that holds the model)")
    exp.add_argument("--overwrite", action="store_true", help="replace the weights HF_DIR holds (by default a "
                     "folder with weights is refused: transformers could load those instead)")
    exp.add_argument("--hf-config", default=None, help="a Hub config.json (or its folder) whose other fields "
                                                        "(token ids) the export keeps")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            print(f"wrote {import_directory(args.hf_dir, args.ckpt_dir)}")
            return 0
        ckpt = args.ckpt_dir if args.iteration is None else checkpoint.iteration_dir(args.ckpt_dir, args.iteration)
        export_checkpoint(ckpt, args.hf_dir, args.dtype, args.family, args.hf_config, args.overwrite)
        print(f"wrote {args.hf_dir}")
    except (CheckpointError, CheckpointMismatch, UnsupportedModel, ConfigError, FileNotFoundError, FileExistsError,
            KeyError) as exc:
        parser.error(str(exc).strip("'\""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
