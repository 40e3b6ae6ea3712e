#!/usr/bin/env python
"""What checkpoint checksums cost: save and load with them against the same without.

    python tools/bench_checkpoint_checksums.py [--rounds 5] [--dir /tmp]

One process holds a GPT-MoE (4 layers, hidden 256, 8 experts, vocab 32k: ~18M params, ~230 MB of fp32
masters and Adam moments) after one step. In alternating rounds (this machine is noisy) it saves a checkpoint
with the shards hashed as written, and without (DCP's plain writer, no manifest), then loads each (the first
verifying the files it reads). Printed: the median wall time of each and the checksums' share. The CPU model
and the folder's file system are named: a figure holds for the machine it ran on.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from moezero import checkpoint  # noqa: E402
from moezero.checkpoint import checksums  # noqa: E402
from moezero.config import GPTConfig, MoEConfig  # noqa: E402
from moezero.models import GPTModel, language_model_loss  # noqa: E402
from moezero.zero import ZeroOptimizer  # noqa: E402
from tools.bench.machine import cpu_model  # noqa: E402

GPT = GPTConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=64, vocab_size=32000, moe_layer_freq=1)
MOE = MoEConfig(num_experts=8, top_k=2)


class _PlainWriter(FileSystemWriter):
    """DCP's writer as it comes: nothing hashed."""

    def digests(self):
        return {}


def _stepped():
    model = GPTModel(GPT, MOE, seed=0)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-4)
    tokens = torch.randint(0, GPT.vocab_size, (2, GPT.seq_length + 1))
    logits, stats = model(tokens[:, :-1])
    loss = language_model_loss(logits, tokens[:, 1:], torch.ones(2, GPT.seq_length))
    (loss + sum(s.aux_loss for s in stats)).backward()
    opt.step()
    return model, opt


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _round(model, opt, root, hashed):
    shutil.rmtree(root, ignore_errors=True)
    checksums.HashingWriter = checksums_writer if hashed else _PlainWriter
    save = _timed(lambda: checkpoint.save_checkpoint(root, 1, model, opt, configs={}, plugins={}))
    path = checkpoint.iteration_dir(root, 1)
    if not hashed:
        os.remove(os.path.join(path, checksums.MANIFEST))  # only the index's record: nothing to verify
    load = _timed(lambda: checkpoint.load_checkpoint(path, model, opt))
    return save, load


checksums_writer = checksums.HashingWriter


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args()
    model, opt = _stepped()
    root = tempfile.mkdtemp(dir=args.dir)
    times = {True: [], False: []}
    try:
        _round(model, opt, os.path.join(root, "warm"), True)
        for _ in range(args.rounds):
            for hashed in (False, True):
                times[hashed].append(_round(model, opt, os.path.join(root, str(hashed)), hashed))
        size = sum(
            os.path.getsize(os.path.join(folder, f))
            for folder, _, files in os.walk(os.path.join(root, "True"))
            for f in files
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fs = os.popen(f"df -T {args.dir} | tail -1").read().split()
    print(
        f"CPU: {cpu_model()}; folder {args.dir} on {fs[1] if len(fs) > 1 else '?'}; checkpoint {size / 2**20:.0f} MB;"
        f" {args.rounds} rounds\n"
    )
    print("| | without checksums (s) | with (s) | added |")
    print("|---|---|---|---|")
    for i, what in enumerate(("save", "load")):
        plain = statistics.median(t[i] for t in times[False])
        hashed = statistics.median(t[i] for t in times[True])
        print(f"| {what} | {plain:.3f} | {hashed:.3f} | {100 * (hashed / plain - 1):+.1f}% |")


if __name__ == "__main__":
    main()
