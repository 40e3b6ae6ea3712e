"""Checksums on two ranks: a shard only one rank reads is damaged; every rank refuses the checkpoint with the
same line (the check is agreed before DCP's collective read, so no rank loads and none waits)."""
import os

import torch
import torch.distributed as dist

from moezero import checkpoint
from moezero.parallel import ParallelGroups
from tests.dist_utils import run_distributed
from tests.unit.test_checkpoint import GPT, MOE


def _model_and_optimizer(groups):
    from moezero.models import GPTModel
    from moezero.zero import ZeroOptimizer

    model = GPTModel(GPT, MOE, seed=3)   # ep 1: every rank holds every expert
    return model, ZeroOptimizer(model, torch.optim.AdamW, groups, stage=2, lr=1e-2)


def _refusals(root):
    groups = ParallelGroups.build()
    model, opt = _model_and_optimizer(groups)
    path = checkpoint.save_checkpoint(root, 1, model, opt, configs={}, plugins={})
    if dist.get_rank() == 0:
        with open(os.path.join(path, "__1_0.distcp"), "r+b") as f:
            f.seek(os.path.getsize(f.name) - 50)
            f.write(b"\x00\x01\x02")
    dist.barrier()
    try:
        checkpoint.load_checkpoint(path, model, opt)
    except checkpoint.CheckpointError as error:
        return str(error)
    return None


def test_a_shard_one_rank_reads_is_refused_by_every_rank(tmp_path):
    first, second = run_distributed(_refusals, 2, str(tmp_path / "ckpt"))
    assert first == second and "__1_0.distcp: its contents differ" in first
