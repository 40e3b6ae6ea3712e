#!/usr/bin/env python
"""Export a (sharded) moezero checkpoint as a quantized inference model: packed int4/int8 weights.

    python tools/export_quantized.py --load checkpoints/gpt_moe_qat --output model.mzq
    python tools/export_quantized.py --load checkpoints/gpt_moe --output ptq.mzq --weight-bits 4 --groups 128

By default the weights are quantized as the run's QAT did (its --qat-* target settings); the
flags below override them, or quantize a run trained without QAT (post-training quantization).
Load the file with `moezero.compression.inference.load_quantized_model` on any number of ranks;
evaluate it with tools/eval_quantized.py.
"""

import argparse
import dataclasses
import sys

import torch

from moezero.compression.config import QATConfig
from moezero.compression.export import export_quantized, packed_bytes
from moezero.compression.source import load_checkpoint_model
from moezero.config import ConfigError
from moezero.checkpoint.errors import first_line
from moezero.training.args import ArgumentParser, prepare_output_file


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--load", required=True, help="checkpoint: the run's --save directory or an iter_N folder")
    parser.add_argument("--output", required=True, help="path of the quantized model file")
    parser.add_argument("--weight-bits", type=int, default=None, help="bits (default: the run's --qat-weight-bits)")
    parser.add_argument("--groups", type=int, default=None, help="groups per tensor / per expert (default: the run's)")
    parser.add_argument(
        "--symmetric",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="symmetric or asymmetric (default: the run's)",
    )
    parser.add_argument("--modules", default=None, help="comma list of module groups (default: the run's)")
    parser.add_argument("--activation-bits", type=int, default=None, help="default: the run's")
    return parser


def quantization_spec(run_qat, args) -> QATConfig:
    """The run's QAT settings at their target bits, with the command line's overrides."""
    overrides = {
        k: v
        for k, v in dict(
            weight_bits=args.weight_bits,
            groups=args.groups,
            symmetric=args.symmetric,
            modules=args.modules,
            activation_bits=args.activation_bits,
        ).items()
        if v is not None
    }
    if run_qat is None and args.weight_bits is None:
        raise ConfigError("--weight-bits: the checkpoint was trained without QAT; give the bits to quantize to")
    return dataclasses.replace(run_qat or QATConfig(weight_bits=args.weight_bits), start_bits=None, **overrides)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        prepare_output_file(args.output)
        source = load_checkpoint_model(args.load)
        spec = quantization_spec(source.qat, args)
        exported = export_quantized(source, spec)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    try:
        torch.save(exported, args.output)
    except (OSError, RuntimeError) as exc:  # torch.save's writer raises RuntimeError for a failed write
        parser.error(f"--output={args.output}: {first_line(exc)}")
    sizes = packed_bytes(exported)
    print(
        f"wrote {args.output}: {len(exported['quantized'])} tensors at {spec.weight_bits} bits "
        f"({sizes['quantized']:,} bytes with scales) + {len(exported['tensors'])} fp tensors "
        f"({sizes['fp']:,} bytes), from {source.path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
