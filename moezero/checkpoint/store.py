"""Save and load training checkpoints with torch.distributed.checkpoint (DCP), and read them offline.

Each rank saves the optimizer pieces it owns (`opt.state_dict()["pieces"]`, global coordinates, see
`keys`), the model's non-trainable tensors, the train state and its RNG states; DCP writes the per-rank
files in parallel and deduplicates replicated entries. Loading is a planned partial read of the pieces
that overlap this rank's `opt.held_ranges()`, so a checkpoint of one dp/ep/stage layout resumes on
another. Offline, `consolidate_checkpoint` merges every rank's pieces with `moezero.zero.consolidate`
(which checks that they cover every element exactly once).
"""
from __future__ import annotations

import contextlib
import random
import warnings
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from moezero.checkpoint import keys, layout
from moezero.zero import consolidate


def save_checkpoint(root: str, iteration: int, model: nn.Module, opt, configs: Dict[str, Any],
                    plugins: Dict[str, Any], group=None) -> str:
    """Collective: write iteration `iteration` atomically and point the pointer file at it.

    `configs` ({section: dict}) and `plugins` ({name: state}) go into the train state (see `keys`).
    """
    if _rank() == 0:
        layout.remove_stale(root)
    _barrier(group)
    shard = opt.state_dict()
    train_state = {"iteration": iteration, "world_size": _world_size(), "param_shapes": shard["shapes"],
                   "optimizer": opt.scalar_state(), "configs": configs, "plugins": plugins}
    state: Dict[str, Any] = keys.piece_entries(shard["pieces"])
    state.update(keys.non_trainable_state(model))
    state[keys.TRAIN_STATE] = keys.encode(train_state)
    state[keys.rng_key(_rank())] = keys.encode(_rng_state())
    with _quiet():
        dcp.save(state, checkpoint_id=layout.staging_dir(root, iteration), no_dist=not dist.is_initialized(),
                 process_group=group)
    _barrier(group)
    final = layout.publish(root, iteration) if _rank() == 0 else layout.iteration_dir(root, iteration)
    _barrier(group)
    return final


def load_checkpoint(path: str, model: nn.Module, opt, group=None) -> Dict[str, Any]:
    """Collective: restore the optimizer, the model's non-trainable state and (same world size) the RNG
    states; returns the train state."""
    metadata = _metadata(path)
    request: Dict[str, Any] = {key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
                               for key in keys.piece_keys(metadata, opt.held_ranges())}
    non_trainable = keys.non_trainable_state(model)
    for key, tensor in non_trainable.items():
        if key not in metadata:
            raise KeyError(f"checkpoint {path} lacks '{key[len(keys.MODEL_STATE):]}' (a different model?)")
        request[key] = torch.empty_like(tensor)
    request[keys.TRAIN_STATE] = b""
    rng_key = keys.rng_key(_rank())
    if rng_key in metadata:
        request[rng_key] = b""
    _load(request, path, collective=True, group=group)
    train_state = keys.train_state_sections(keys.decode(request[keys.TRAIN_STATE]))
    opt.load_state_dict({"pieces": keys.pieces_from_entries(request), **train_state["optimizer"]})
    with torch.no_grad():
        for key, tensor in non_trainable.items():
            tensor.copy_(request[key])
    if rng_key in request and train_state["world_size"] == _world_size():
        _set_rng_state(keys.decode(request[rng_key]))
    return train_state


def read_train_state(path: str) -> Dict[str, Any]:
    """One process, no process group: the train state of checkpoint `path` (see `save_checkpoint`)."""
    request: Dict[str, Any] = {keys.TRAIN_STATE: b""}
    _load(request, path)
    return keys.train_state_sections(keys.decode(request[keys.TRAIN_STATE]))


def consolidate_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    """One process, no process group: the full model of a checkpoint of any layout, {name: tensor}:
    fp32 masters of the trainable params (experts stacked over all global experts) and the
    non-trainable state. Raises ValueError unless the saved pieces cover every element exactly once."""
    metadata = _metadata(path)
    model_keys = [key for key in metadata if key.startswith(keys.MODEL_STATE)]
    request: Dict[str, Any] = {key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
                               for key in keys.piece_keys(metadata, None, masters_only=True) + model_keys}
    request[keys.TRAIN_STATE] = b""
    _load(request, path)
    shapes = keys.decode(request[keys.TRAIN_STATE])["param_shapes"]
    full = consolidate([{"pieces": keys.pieces_from_entries(request), "shapes": shapes}])
    return dict(full["params"], **{key[len(keys.MODEL_STATE):]: request[key] for key in model_keys})


# ---- DCP calls ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    """DCP's FutureWarnings, and its note that it runs "in a single process" without a process group
    (the intent of an offline read), are not the user's business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _metadata(path: str):
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _load(request: Dict[str, Any], path: str, collective: bool = False, group=None) -> None:
    """Fill `request` in place from `path`, reading only its keys; `collective`: every rank of `group`
    calls it (a resume), else this process reads alone (offline, or each rank on its own)."""
    with _quiet():
        dcp.load(request, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=not (collective and dist.is_initialized()), process_group=group)


# ---- ranks and RNG -----------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rng_state() -> Dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
