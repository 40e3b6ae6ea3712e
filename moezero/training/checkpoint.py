"""Checkpoints on torch.distributed.checkpoint (DCP): sharded, atomic, loadable into any layout.

Layout of `--save DIR`:
    DIR/iter_0000100/            one DCP checkpoint: .metadata + one __<rank>_0.distcp per rank
    DIR/latest_checkpointed_iteration.txt   written last, atomically (Megatron's pointer file)

What is saved: every rank's optimizer pieces (fp32 master weights and optimizer state) under keys
naming the param and the *global* element range they cover; the model's non-trainable tensors
(buffers such as the expert bias, frozen params); the training state (iteration, consumed samples,
loss scaler, skip counters, lr); each rank's RNG states. DCP writes the per-rank files in parallel,
deduplicates replicated entries and stores the metadata. Because every piece is addressed by global
coordinates, loading is a planned partial read of the pieces that overlap this rank's ranges, so a
checkpoint written with one dp/ep/stage layout resumes on another.

Atomicity: a save goes to `iter_N.tmp`, is renamed to `iter_N` only after every rank finished
writing, and the pointer file is replaced last; a crash or Ctrl-C at any point leaves the previous
checkpoint and pointer intact (stale `.tmp` folders are ignored and removed by the next save).
"""
from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import warnings
from typing import Any, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


POINTER = "latest_checkpointed_iteration.txt"
_PIECE_KEY = re.compile(r"^optimizer/(?P<name>.+)/(?P<lo>\d+)-(?P<hi>\d+)/(?P<field>[^/]+)$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the pointer file names, or None when there is no checkpoint."""
    path = os.path.join(root, POINTER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit() or not os.path.isdir(iteration_dir(root, int(text))):
        raise FileNotFoundError(f"--load={root}: {POINTER} names iteration {text!r}, which has no checkpoint folder")
    return int(text)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def save_checkpoint(root: str, iteration: int, model: nn.Module, opt, train_state: Dict[str, Any], group=None) -> str:
    """Collective: write iteration `iteration` atomically and point the pointer file at it."""
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        for stale in (p for p in os.listdir(root) if p.endswith(".tmp")):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    _barrier(group)
    state = _optimizer_entries(opt)
    state.update({f"model_state/{k}": v for k, v in _non_trainable_state(model).items()})
    state["train_state"] = _encode(train_state)
    state[f"rng/rank{_rank()}"] = _encode(_rng_state())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized(), process_group=group)
    _barrier(group)
    if _rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = os.path.join(root, POINTER + ".tmp")
        with open(pointer_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, os.path.join(root, POINTER))
    _barrier(group)
    return final


def load_checkpoint(path: str, model: nn.Module, opt, group=None) -> Dict[str, Any]:
    """Collective: restore optimizer, model state and (same world size) RNG; return the train state."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    request: Dict[str, Any] = {}
    wanted = _wanted_piece_keys(opt, metadata)
    for key in wanted:
        request[key] = torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
    non_trainable = _non_trainable_state(model)
    for name, tensor in non_trainable.items():
        key = f"model_state/{name}"
        if key not in metadata:
            raise KeyError(f"checkpoint {path} lacks '{name}' (a different model?)")
        request[key] = torch.empty_like(tensor)
    request["train_state"] = b""
    rng_key = f"rng/rank{_rank()}"
    if rng_key in metadata:
        request[rng_key] = b""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.load(request, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=not dist.is_initialized(), process_group=group)
    train_state = _decode(request["train_state"])
    opt.load_state_dict({"pieces": _pieces_from_entries(request), "param_groups": train_state["param_groups"],
                         "loss_scaler": train_state.get("loss_scaler"), "skipped_steps": train_state["skipped_steps"],
                         "consecutive_skips": train_state["consecutive_skips"]})
    with torch.no_grad():
        for name, tensor in non_trainable.items():
            tensor.copy_(request[f"model_state/{name}"])
    if rng_key in request and train_state.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1):
        _set_rng_state(_decode(request[rng_key]))
    return train_state


def global_param_shapes(opt) -> Dict[str, tuple]:
    """Global shape of every trainable param (experts stacked over all global experts)."""
    return opt.state_dict()["shapes"]


def consolidate_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    """One process, no process group: the full model (fp32 masters of trainable params, global expert
    stacks, plus non-trainable state) from a sharded checkpoint of any layout."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    request: Dict[str, Any] = {"train_state": b""}
    for key, meta in metadata.items():
        if isinstance(meta, TensorStorageMetadata) and (key.startswith("model_state/") or
                                                        key.endswith("/master")):
            request[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dcp.load(request, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    shapes = _decode(request["train_state"])["param_shapes"]
    model: Dict[str, torch.Tensor] = {}
    for name, pieces in _pieces_from_entries(request).items():
        flat = torch.zeros(int(torch.Size(shapes[name]).numel()), dtype=torch.float32)
        for piece in pieces:
            lo, hi = piece["range"]
            flat[lo:hi] = piece["master"]
        model[name] = flat.view(shapes[name])
    for key, value in request.items():
        if key.startswith("model_state/"):
            model[key[len("model_state/"):]] = value
    return model


# ---- optimizer pieces ------------------------------------------------------------------------------
def _optimizer_entries(opt) -> Dict[str, Any]:
    entries: Dict[str, Any] = {}
    for name, pieces in opt.state_dict()["pieces"].items():
        for piece in pieces:
            lo, hi = piece["range"]
            prefix = f"optimizer/{name}/{lo}-{hi}"
            entries[f"{prefix}/master"] = piece["master"]
            for key, value in piece["state"].items():
                entries[f"{prefix}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return entries


def _wanted_piece_keys(opt, metadata) -> list:
    """Keys of the saved pieces that overlap this rank's optimizer views (global coordinates)."""
    needed = opt.held_ranges()
    keys = []
    for key in metadata:
        match = _PIECE_KEY.match(key)
        if not match or not isinstance(metadata[key], TensorStorageMetadata):
            continue
        lo, hi = int(match["lo"]), int(match["hi"])
        if any(a < hi and lo < b for a, b in needed.get(match["name"], [])):
            keys.append(key)
    return keys


def _pieces_from_entries(entries: Dict[str, Any]) -> Dict[str, list]:
    pieces: Dict[str, Dict[tuple, Dict[str, Any]]] = {}
    for key, value in entries.items():
        match = _PIECE_KEY.match(key)
        if not match:
            continue
        rng = (int(match["lo"]), int(match["hi"]))
        piece = pieces.setdefault(match["name"], {}).setdefault(rng, {"range": rng, "master": None, "state": {}})
        if match["field"] == "master":
            piece["master"] = value
        else:
            piece["state"][match["field"]] = value
    return {name: list(by_range.values()) for name, by_range in pieces.items()}


# ---- model state, train state and RNG ----------------------------------------------------------------
def _non_trainable_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Buffers and frozen params: what the optimizer does not hold (expert-parallel ones keyed by ep rank)."""
    from moezero.parallel import expert_shard_of

    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in trainable:
            continue
        shard = expert_shard_of(tensor)
        key = name if shard is None else f"{name}@experts{shard.first_global_expert}"
        out[key] = tensor.detach() if isinstance(tensor, nn.Parameter) else tensor
    return out


def _encode(obj: Any) -> bytes:
    return pickle.dumps(obj)


def _decode(blob: Any) -> Any:
    return pickle.loads(blob) if isinstance(blob, (bytes, bytearray)) else blob


def _rng_state() -> Dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
