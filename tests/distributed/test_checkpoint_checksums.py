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

    model = GPTModel(GPT, MOE, seed=3)  # ep 1: every rank holds every expert
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


def _publishing_fails_on_rank_0(root):
    """Rank 0 alone writes the manifest and moves the pointer: its failure (a disk that filled) is agreed."""
    from moezero.checkpoint import checksums

    groups = ParallelGroups.build()
    model, opt = _model_and_optimizer(groups)
    checkpoint.save_checkpoint(root, 1, model, opt, configs={}, plugins={})
    write_manifest = checksums.write_manifest

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if dist.get_rank() == 0:
        checksums.write_manifest = full
    try:  # the workers outlive the test: the patch goes with it
        checkpoint.save_checkpoint(root, 2, model, opt, configs={}, plugins={})
    except checkpoint.CheckpointError as error:
        return str(error), checkpoint.latest_iteration(root)
    finally:
        checksums.write_manifest = write_manifest
        groups.destroy()
    return None, checkpoint.latest_iteration(root)


def test_a_manifest_rank_0_cannot_write_is_one_error_on_every_rank(tmp_path):
    (first, latest0), (second, latest1) = run_distributed(_publishing_fails_on_rank_0, 2, str(tmp_path / "ckpt"))
    assert "publishing iteration 2 failed (OSError: [Errno 28] No space left" in first  # rank 0's, the one shown
    assert "publishing iteration 2 failed (rank 0 could not write" in second
    assert latest0 == latest1 == 1
