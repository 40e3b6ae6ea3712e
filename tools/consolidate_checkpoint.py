#!/usr/bin/env python
"""Write one fp32 model file from a sharded moezero checkpoint (any dp/ep/stage layout).

    python tools/consolidate_checkpoint.py --load checkpoints/gpt_moe_small [--iteration N] --output model.pt

The output is a plain `torch.save` dict {param name: tensor}: trainable params are the fp32 master
weights, routed-expert tensors are stacked over all global experts (shape (E, ...)), and buffers
(e.g. the router expert bias) are included. It loads into a GPTModel built with ep = 1.
"""
import argparse
import os
import sys

import torch

from moezero import checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="checkpoint directory (the training run's --save)")
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    parser.add_argument("--output", required=True, help="path of the consolidated .pt file")
    args = parser.parse_args(argv)
    iteration = args.iteration if args.iteration is not None else checkpoint.latest_iteration(args.load)
    if iteration is None:
        parser.error(f"--load={args.load}: no checkpoint found (no {checkpoint.POINTER})")
    path = checkpoint.iteration_dir(args.load, iteration)
    if not os.path.isdir(path):
        parser.error(f"--iteration={iteration}: {path} does not exist")
    model = checkpoint.consolidate_checkpoint(path)
    torch.save(model, args.output)
    total = sum(t.numel() for t in model.values())
    print(f"wrote {args.output}: {len(model)} tensors, {total:,} elements, from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
