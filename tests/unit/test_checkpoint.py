"""The checkpoint format on one process: save, offline reads (train state, consolidation with its
coverage check) and a resume into a fresh model and optimizer."""

import os
import re

import pytest
import torch

from moezero import checkpoint
from moezero.checkpoint import layout
from moezero.config import GPTConfig, MoEConfig
from moezero.models import GPTModel, language_model_loss
from moezero.zero import ZeroOptimizer

GPT = GPTConfig(
    num_layers=2,
    hidden_size=16,
    num_attention_heads=2,
    seq_length=8,
    vocab_size=32,
    moe_layer_freq=1,
    untie_embeddings_and_output_weights=True,
)
MOE = MoEConfig(num_experts=4, top_k=2, enable_expert_bias=True)


def _trained(steps):
    model = GPTModel(GPT, MOE, seed=3)
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-2)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        logits, stats = model(tokens[:, :-1])
        loss = language_model_loss(logits, tokens[:, 1:], torch.ones(2, 8)) + sum(s.aux_loss for s in stats)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_save_consolidate_and_resume(tmp_path):
    model, opt = _trained(2)
    root = str(tmp_path / "ckpt")
    path = checkpoint.save_checkpoint(root, 2, model, opt, configs={"model": {"seed": 3}}, plugins={"p": {"n": 1}})
    assert checkpoint.latest_iteration(root) == 2 and checkpoint.resolve_checkpoint(root) == path
    state = checkpoint.read_train_state(path)
    assert (state["iteration"], state["world_size"], state["configs"], state["plugins"]) == (
        2,
        1,
        {"model": {"seed": 3}},
        {"p": {"n": 1}},
    )
    full = checkpoint.consolidate_checkpoint(path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(full[name], tensor), name
    fresh, fresh_opt = _trained(0)
    assert checkpoint.load_checkpoint(path, fresh, fresh_opt)["iteration"] == 2
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_opt.scalar_state() == opt.scalar_state()


class _LostPieces:
    """An optimizer whose saved pieces miss one param, as if a rank's pieces were never written."""

    def __init__(self, opt):
        self.opt = opt

    def state_dict(self):
        shard = self.opt.state_dict()
        shard["pieces"].pop("embedding.weight")
        return shard

    def scalar_state(self):
        return self.opt.scalar_state()

    @property
    def param_groups(self):
        return self.opt.param_groups


def test_consolidation_checks_coverage(tmp_path):
    model, opt = _trained(1)
    path = checkpoint.save_checkpoint(str(tmp_path), 1, model, _LostPieces(opt), configs={}, plugins={})
    with pytest.raises(ValueError, match="embedding.weight"):
        checkpoint.consolidate_checkpoint(path)


def test_train_state_of_older_checkpoints_reads_in_sections():
    from moezero.checkpoint.keys import train_state_sections

    old = {
        "iteration": 4,
        "world_size": 2,
        "param_shapes": {},
        "configs": {},
        "qat": {"step": 4, "bits": 5},
        "param_groups": [{"lr": 0.1}],
        "loss_scaler": None,
        "skipped_steps": 1,
        "consecutive_skips": 0,
    }
    state = train_state_sections(old)
    assert state["optimizer"] == {
        "param_groups": [{"lr": 0.1}],
        "loss_scaler": None,
        "skipped_steps": 1,
        "consecutive_skips": 0,
    }
    assert state["plugins"] == {"qat": {"step": 4, "bits": 5}}
    assert train_state_sections(state) is state


def _with_frozen(stage, hold_frozen, steps):
    """A GPT whose final norm and experts of layer 1 are frozen; the optimizer holds them or not."""
    model = GPTModel(GPT, MOE, seed=3)
    frozen = [model.final_norm.weight, model.layers[1].mlp.experts.w1]
    for p in frozen:
        p.requires_grad_(False)
    groups = model.parameters() if hold_frozen else [p for p in model.parameters() if p.requires_grad]
    opt = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, param_groups=groups)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        logits, _ = model(tokens[:, :-1])
        language_model_loss(logits, tokens[:, 1:], torch.ones(2, 8)).backward()
        opt.step()
        opt.zero_grad()
    if steps == 0:  # a fresh model: the frozen values must come from the checkpoint
        with opt.modify_model(), torch.no_grad():
            for p in frozen:
                p.zero_()
    return model, opt


def _full_state(model, opt):
    with opt.full_parameters():
        return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_frozen_params_held_by_a_stage3_optimizer_save_and_resume(tmp_path):
    for saved_held in (True, False):  # False: frozen params kept beside the optimizer (older checkpoints)
        model, opt = _with_frozen(3, saved_held, 2)
        path = checkpoint.save_checkpoint(str(tmp_path / str(saved_held)), 2, model, opt, configs={}, plugins={})
        expected = _full_state(model, opt)
        full = checkpoint.consolidate_checkpoint(path)
        for name, tensor in expected.items():  # a param beside the optimizer keeps its expert suffix there
            assert torch.equal(full.get(name, full.get(f"{name}@experts0")), tensor), name
        fresh, fresh_opt = _with_frozen(3, True, 0)
        checkpoint.load_checkpoint(path, fresh, fresh_opt)
        for name, tensor in _full_state(fresh, fresh_opt).items():
            assert torch.equal(tensor, expected[name]), (saved_held, name)


def test_an_unfinished_save_is_ignored_by_a_load_and_removed_by_the_next_save(tmp_path):
    model, opt = _trained(1)
    root = str(tmp_path / "ckpt")
    checkpoint.save_checkpoint(root, 2, model, opt, configs={}, plugins={})
    os.makedirs(os.path.join(root, "iter_0000005.tmp"))  # a save interrupted before its rename
    with open(os.path.join(root, "iter_0000005.tmp", "__0_0.distcp"), "wb") as f:
        f.write(b"partial")
    assert checkpoint.latest_iteration(root) == 2 and checkpoint.saved_iterations(root) == [2]
    assert checkpoint.resolve_checkpoint(root) == checkpoint.iteration_dir(root, 2)
    fresh, fresh_opt = _trained(0)
    assert checkpoint.load_checkpoint(checkpoint.resolve_checkpoint(root), fresh, fresh_opt)["iteration"] == 2
    checkpoint.save_checkpoint(root, 3, model, opt, configs={}, plugins={})
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", checkpoint.POINTER]


@pytest.mark.parametrize(
    "remove,needle",
    [
        (".metadata", "has no .metadata (not a checkpoint folder)"),
        ("__0_0.distcp", "__0_0.distcp: is missing; the checkpoint is incomplete"),
    ],
)
def test_a_missing_index_or_shard_file_is_a_checkpoint_error_naming_it(tmp_path, remove, needle):
    model, opt = _trained(1)
    path = checkpoint.save_checkpoint(str(tmp_path), 1, model, opt, configs={}, plugins={})
    os.remove(os.path.join(path, remove))
    fresh, fresh_opt = _trained(0)
    for read in (
        lambda: checkpoint.read_train_state(path),
        lambda: checkpoint.consolidate_checkpoint(path),
        lambda: checkpoint.load_checkpoint(path, fresh, fresh_opt),
    ):
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(needle)):
            read()


# ---- checksums: recorded as written, verified before a read ----------------------------------------------------
def test_the_digests_recorded_as_written_are_the_files_digests(tmp_path):
    """The hashes taken as DCP wrote each shard equal the files' own; the checkpoint stays plain DCP (torch reads
    it without moezero's help); a checkpoint without a manifest (written before checksums) still loads."""
    import json

    import torch.distributed.checkpoint as dcp
    from moezero.checkpoint import checksums, keys

    model, opt = _trained(2)
    path = checkpoint.save_checkpoint(str(tmp_path), 2, model, opt, configs={}, plugins={})
    with open(os.path.join(path, checksums.MANIFEST)) as f:
        manifest = json.load(f)
    shards = sorted(name for name in os.listdir(path) if name.endswith(".distcp"))
    assert manifest["iteration"] == 2 and sorted(manifest["files"]) == [".metadata"] + shards
    for name, record in manifest["files"].items():
        assert checksums.file_record(os.path.join(path, name)) == record, name
    plain = {keys.TRAIN_STATE: b""}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert keys.decode(plain[keys.TRAIN_STATE])["iteration"] == 2
    os.remove(os.path.join(path, checksums.MANIFEST))
    fresh, fresh_opt = _trained(0)
    assert checkpoint.load_checkpoint(path, fresh, fresh_opt)["iteration"] == 2


def test_every_reader_refuses_a_changed_file(tmp_path):
    model, opt = _trained(1)
    path = checkpoint.save_checkpoint(str(tmp_path), 1, model, opt, configs={}, plugins={})
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:  # one bit of the last entry (a tensor, not the train state read first)
        f.seek(os.path.getsize(shard) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    fresh, fresh_opt = _trained(0)
    for read in (
        lambda: checkpoint.read_train_state(path),
        lambda: checkpoint.consolidate_checkpoint(path),
        lambda: checkpoint.load_checkpoint(path, fresh, fresh_opt),
    ):
        with pytest.raises(checkpoint.CheckpointError, match=re.escape(f"{shard}: its contents differ")):
            read()


def _fake_checkpoints(root, iterations, pointer):
    for iteration in iterations:
        os.makedirs(checkpoint.iteration_dir(str(root), iteration))
    with open(os.path.join(str(root), checkpoint.POINTER), "w") as f:
        f.write(str(pointer))


def test_pruning_after_a_rollback_keeps_the_checkpoint_resumed_from(tmp_path):
    # A run saved 10, 20, 30; the user resumed from 10 (--ckpt-step) and this run just published 15.
    _fake_checkpoints(tmp_path, [10, 15, 20, 30], pointer=15)
    assert layout.prune(str(tmp_path), 2) == []
    assert checkpoint.saved_iterations(str(tmp_path)) == [10, 15, 20, 30]
    assert layout.prune(str(tmp_path), 1) == [10]  # the abandoned run's 20 and 30 are not this run's history
    assert checkpoint.saved_iterations(str(tmp_path)) == [15, 20, 30]


def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    _fake_checkpoints(tmp_path, [1, 2, 3], pointer=3)
    with open(os.path.join(checkpoint.iteration_dir(str(tmp_path), 1), "__0_0.distcp"), "wb") as f:
        f.write(b"shard")
    real_rmtree = layout.shutil.rmtree

    def killed(path, ignore_errors=False):
        if os.path.exists(path):
            raise KeyboardInterrupt  # the signal lands inside the deletion

    monkeypatch.setattr(layout.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        layout.prune(str(tmp_path), 2)
    assert checkpoint.saved_iterations(str(tmp_path)) == [2, 3]  # 1 is gone from the checkpoints at once
    monkeypatch.setattr(layout.shutil, "rmtree", real_rmtree)
    layout.remove_stale(str(tmp_path))  # the next save clears what the kill left
    assert sorted(os.listdir(str(tmp_path))) == ["iter_0000002", "iter_0000003", checkpoint.POINTER]
