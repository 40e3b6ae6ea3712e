#!/usr/bin/env python
"""Write one fp32 model file from a sharded moezero checkpoint (any dp/ep/stage layout).

    python tools/consolidate_checkpoint.py --load checkpoints/gpt_moe_small [--iteration N] --output model.pt

The output (`torch.load(path)`) is a dict: "model" {param name: tensor} holds the fp32 master weights
(routed-expert tensors stacked over all global experts, shape (E, ...); QAT's parametrized weights under
their plain names) and the buffers (e.g. the router expert bias), and loads into a GPTModel built with
ep = 1; "configs" holds the run's configs (every section), so tools/generate.py, export_quantized.py
and eval_quantized.py rebuild the model from the file alone; "iteration" says where the run stood.
"""

import os
import sys

import torch

from moezero import checkpoint
from moezero.compression.source import consolidated_file, load_checkpoint_model
from moezero.checkpoint.errors import first_line
from moezero.training.args import ArgumentParser, prepare_output_file


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--load", required=True, help="checkpoint directory (the training run's --save)")
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    parser.add_argument("--output", required=True, help="path of the consolidated .pt file")
    args = parser.parse_args(argv)
    try:
        prepare_output_file(args.output)
        if args.iteration is None:
            path = checkpoint.resolve_checkpoint(args.load)
        else:
            path = checkpoint.iteration_dir(args.load, args.iteration)
            if not os.path.isdir(path):
                raise checkpoint.CheckpointError(
                    f"--iteration={args.iteration}: {path} does not exist (saved: "
                    f"{checkpoint.saved_iterations(args.load)})"
                )
        source = load_checkpoint_model(path)
    except ValueError as exc:  # CheckpointError, ConfigError, and an incomplete set of shards
        parser.error(str(exc))
    try:
        torch.save(consolidated_file(source), args.output)
    except (OSError, RuntimeError) as exc:  # torch.save's writer raises RuntimeError for a failed write
        parser.error(f"--output={args.output}: {first_line(exc)}")
    total = sum(t.numel() for t in source.state.values())
    print(f"wrote {args.output}: {len(source.state)} tensors, {total:,} elements, with the run's configs, from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
