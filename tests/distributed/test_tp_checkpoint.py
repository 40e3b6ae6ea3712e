"""A checkpoint of ZeRO over tensor-parallel layers (test_tp_regions' harness: the GLU MLP at tp 2, dp 1) written by
save_checkpoint and resumed at tp 1 by load_checkpoint: the strided pieces of the fused fc1 and the row-parallel fc2
put every weight and optimizer state element where the tp-2 ranks held it."""

import dataclasses

import torch
import torch.distributed as dist

from moezero.checkpoint import CheckpointReader, consolidate_checkpoint, keys, load_checkpoint, save_checkpoint
from moezero.checkpoint.store import _index
from moezero.parallel import ParallelGroups
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.distributed.test_tp_regions import ADAMW, TP, _mlp_reference, _tp_group, _TPMLP, _zero_batch


def _local_state(model, opt):
    """{name: (its TensorShard, values, exp_avg)} as this rank holds them."""
    leaves = {id(piece.param.param): piece.master for piece in opt.engine.master_pieces()}
    return {
        name: (tensor_shard_of(p), p.detach().clone(), opt.inner.state[leaves[id(p)]]["exp_avg"].view(p.shape).clone())
        for name, p in model.named_parameters()
    }


def _train_and_save_at_tp2(root):
    tp = _tp_group()
    w, _, _ = _mlp_reference(glu=True, bias=True, seed=700)
    model = _TPMLP(tp, False)
    model.fc1.copy_from_global_(w["w1"], w["b1"])
    model.fc2.copy_from_global_(w["w2"], w["b2"])
    opt = ZeroOptimizer(model, torch.optim.AdamW, dataclasses.replace(ParallelGroups.single(), tp=tp), **ADAMW)
    for step in range(2):
        x, target = _zero_batch(step)
        ((model(x) - target).square().sum() / target.numel()).backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(root, 2, model, opt, configs={}, plugins={}, group=dist.group.WORLD)
    return _local_state(model, opt)


def _piece_keys(path):
    return keys.piece_keys(_index(path).state_dict_metadata, None)


def _load_at_tp2(path):
    model = _TPMLP(_tp_group(), False)
    opt = ZeroOptimizer(model, torch.optim.AdamW, dataclasses.replace(ParallelGroups.single(), tp=_tp_group()), **ADAMW)
    load_checkpoint(path, model, opt, load_rng=False, group=dist.group.WORLD)
    return _local_state(model, opt)


def _check_cuts(whole, ranks):
    """Each rank's values and exp_avg are its cut of the one process's."""
    for name, (_, value, exp_avg) in whole.items():
        for rank_state in ranks:
            shard, local_value, local_exp_avg = rank_state[name]
            cut = shard.local_of if shard is not None else (lambda t: t)
            assert torch.equal(cut(value), local_value) and torch.equal(cut(exp_avg), local_exp_avg), name


def test_a_tp2_checkpoint_resumes_at_tp1_and_back(tmp_path):
    """tp 2 -> tp 1 (and the tp-1 model saved again, plain keys only, -> tp 2)."""
    saved = run_distributed(_train_and_save_at_tp2, TP, str(tmp_path))
    path = str(tmp_path / "iter_0000002")
    piece_keys = _piece_keys(path)
    strided = [key for key in piece_keys if len(keys.piece_of(key)[1]) == 4]
    assert strided and all(key.startswith("optimizer/fc2.weight/") for key in strided), strided
    # four fields of, per rank, fc2.weight's one piece and fc1's weight and bias in two blocks each; fc2.bias once
    assert len(piece_keys) == 4 * ((1 + 2 + 2) * TP + 1), piece_keys
    model = _TPMLP(None, False)
    opt = ZeroOptimizer(model, torch.optim.AdamW, ParallelGroups.single(), **ADAMW)
    load_checkpoint(path, model, opt, load_rng=False)
    whole = _local_state(model, opt)
    full = consolidate_checkpoint(path)
    reader = CheckpointReader(path)  # the offline reader (Hub export) reads across strided pieces too
    for name, (_, value, _) in whole.items():
        assert torch.equal(full[name], value), name
        assert torch.equal(reader.read(name, 3, value.numel() - 2), value.reshape(-1)[3:-2].float()), name  # fp32
    _check_cuts(whole, saved)
    save_checkpoint(str(tmp_path / "tp1"), 2, model, opt, configs={}, plugins={})
    back = str(tmp_path / "tp1" / "iter_0000002")
    assert all(len(keys.piece_of(key)[1]) == 2 for key in _piece_keys(back)), "tp 1 writes plain ranges only"
    _check_cuts(whole, run_distributed(_load_at_tp2, TP, back))
