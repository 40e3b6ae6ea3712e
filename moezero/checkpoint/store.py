"""Save and load training checkpoints with torch.distributed.checkpoint (DCP), and read them offline.

Each rank saves the optimizer pieces it owns (`opt.state_dict()["pieces"]`, global coordinates, see
`keys`), the model's non-trainable tensors, the train state and its RNG states; DCP writes the per-rank
files in parallel and deduplicates replicated entries. Loading is a planned partial read of the pieces
that overlap this rank's `opt.held_ranges()`, so a checkpoint of one dp/ep/stage layout resumes on
another. Offline, `consolidate_checkpoint` merges every rank's pieces with `moezero.zero.consolidate`
(which checks that they cover every element exactly once).

Every read first checks the files (a readable .metadata, every shard file as long as the index says),
so a damaged checkpoint is a `CheckpointError` naming the file, on every rank alike, before any collective.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from moezero.checkpoint import checksums, keys, layout, safe_pickle
from moezero.checkpoint.errors import CheckpointError, first_line, innermost_cause, no_space
from moezero.checkpoint.pending import PendingSave
from moezero.parallel import comm
from moezero.zero import Span, consolidate, intersects, overlap


def save_checkpoint(
    root: str,
    iteration: int,
    model: nn.Module,
    opt,
    configs: Dict[str, Any],
    plugins: Dict[str, Any],
    group=None,
    keep_last: int = 0,
    progress: Optional[Dict[str, int]] = None,
    lr_schedule: Optional[Dict[str, Any]] = None,
    background: bool = False,
    writer_group=None,
    tensorboard_files: Sequence[str] = (),
) -> Union[str, PendingSave]:
    """Collective: write iteration `iteration` atomically and point the pointer file at it; then, with
    `keep_last` > 0, remove all but the newest `keep_last` checkpoints.

    `configs`, `plugins`, `progress`, `lr_schedule` and `tensorboard_files` go into the train state (see `keys`),
    which `load_checkpoint` returns and `read_train_state` reads.

    Args:
        root: the checkpoint folder (--save); the iteration is written to a folder of its own under it.
        iteration: the training iteration the state is of.
        model: the model (its params' values are the optimizer's: fp32 masters; its buffers its own).
        opt: the ZeroOptimizer: each rank writes the shard it holds.
        configs: {section: dict} of the run's configs.
        plugins: {name: state} of the run's plugins (QAT's).
        group: the process group of the save (default: the whole world).
        keep_last: with > 0, remove all but the newest `keep_last` checkpoints after this one is published.
        progress: the consumed samples ({name: count}).
        lr_schedule: the learning-rate schedule and where it stands.
        background: copy the state and write it in the background: a PendingSave is returned, whose
            `finish()` publishes it.
        writer_group: with `background`, the process group of the writer's collectives (its own, never one
            training uses).
        tensorboard_files: the names of the event files the run and those it resumed from wrote (a resume
            rewrites only those).

    Returns:
        The published iteration's folder, or with `background` the PendingSave.
    """
    if group is None and dist.is_initialized():  # the whole world (comm's None is a world of one)
        group = dist.group.WORLD
    if _rank() == 0:
        layout.remove_stale(root)
    _barrier(group)
    shard = opt.state_dict()
    train_state = {
        "iteration": iteration,
        "world_size": _world_size(),
        "param_shapes": shard["shapes"],
        "optimizer": opt.scalar_state(),
        "configs": configs,
        "plugins": plugins,
        "progress": dict(progress or {}),
        "opt_param_scheduler": dict(lr_schedule or {}),
        "tensorboard_files": list(tensorboard_files),
    }
    state: Dict[str, Any] = keys.piece_entries(shard["pieces"])
    state.update(keys.model_state(model, _held_params(opt)))
    state[keys.TRAIN_STATE] = keys.encode(train_state)
    state[keys.rng_key(_rank())] = keys.encode(_rng_state())
    staging = layout.staging_dir(root, iteration)
    writer = checksums.HashingWriter(staging)
    publish = functools.partial(_publish, root, iteration, keep_last, group, writer)
    if background:
        with _quiet():
            future = dcp.async_save(
                state, storage_writer=writer, no_dist=not dist.is_initialized(), process_group=writer_group
            )
        return PendingSave(
            future,
            layout.iteration_dir(root, iteration),
            publish,
            group,
            functools.partial(abandon_save, root, iteration, group),
            functools.partial(_disk_full, staging),
        )
    error = None
    try:
        with _quiet():
            dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized(), process_group=group)
    except (CheckpointException, OSError) as exc:  # a full disk, a vanished mount: agreed below
        error = exc
    if not _all_ok(error is None, group):
        reason = innermost_cause(error) if error is not None else "another rank could not write its part"
        if error is not None and _disk_full(staging):  # torch's writer may report a full disk as a bad offset
            reason = no_space(reason)
        abandon_save(root, iteration, group)
        raise CheckpointError(
            f"--save={root}: saving iteration {iteration} failed ({reason}); its partial "
            "folder is removed and the previous checkpoint stays latest"
        )
    return publish()


def save_read_checkpoint(
    root: str,
    iteration: int,
    ranges: Dict[str, List[Tuple[int, int]]],
    read: Callable[[str, int, int], torch.Tensor],
    model_state: Dict[str, torch.Tensor],
    train_state: Dict[str, Any],
) -> str:
    """One process: iteration `iteration` of `root` as a world of one with fresh optimizer state, whose fp32
    masters of param `name`, pieces `ranges[name]`, `read(name, lo, hi)` returns when DCP writes them, one piece
    per file: at most one piece is in memory (an import that never holds the model). Published as save_checkpoint
    does."""
    state: Dict[str, Any] = {
        f"optimizer/{name}/{lo}-{hi}/master": torch.empty(hi - lo, device="meta")
        for name, pieces in ranges.items()
        for lo, hi in pieces
    }
    state.update({keys.MODEL_STATE + name: tensor for name, tensor in model_state.items()})
    state[keys.TRAIN_STATE] = keys.encode(dict(train_state, iteration=iteration, world_size=1))
    state[keys.rng_key(0)] = keys.encode(_rng_state())
    layout.remove_stale(root)
    writer = checksums.HashingWriter(layout.staging_dir(root, iteration), single_file_per_rank=False, thread_count=1)
    try:
        with _quiet():
            dcp.save(state, storage_writer=writer, planner=_ReadingPlanner(read), no_dist=True)
    except (CheckpointException, OSError) as exc:
        abandon_save(root, iteration, None)
        raise CheckpointError(f"{root}: writing iteration {iteration} failed ({innermost_cause(exc)})") from None
    return _publish(root, iteration, 0, None, writer)


class _ReadingPlanner(DefaultSavePlanner):
    """DCP's planner, reading each meta-device piece's values only when DCP writes it."""

    def __init__(self, read: Callable[[str, int, int], torch.Tensor]):
        super().__init__()
        self._read = read

    def resolve_data(self, write_item):
        value = self.lookup_object(write_item.index)
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            name, (lo, hi) = keys.piece_of(write_item.index.fqn)
            return self._read(name, lo, hi).to(torch.float32).contiguous()
        return super().resolve_data(write_item)


def _disk_full(path: str) -> bool:
    """Whether the file system of `path` (or of the nearest folder that exists) has under 1 MiB free."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free < 2**20
    except OSError:
        return False


def abandon_save(root: str, iteration: int, group) -> None:
    """Collective, after a failed write: rank 0 removes the partial staging folder (the pointer never moved)."""
    if _rank() == 0:
        shutil.rmtree(layout.staging_dir(root, iteration), ignore_errors=True)
    _barrier(group)


def _publish(root: str, iteration: int, keep_last: int, group, writer: checksums.HashingWriter) -> str:
    """Collective, once every rank wrote: rank 0 records every rank's shard digests, renames the staging folder
    into place, moves the pointer, prunes."""
    digests = _gathered(writer.digests(), group)
    error = None
    if _rank() == 0:
        try:
            checksums.write_manifest(layout.staging_dir(root, iteration), iteration, _world_size(), digests)
            layout.publish(root, iteration)
            layout.prune(root, keep_last)
        except OSError as exc:  # a disk that filled after the shards: every rank says so, not rank 0 alone
            error = exc
    if not _all_ok(error is None, group):
        reason = first_line(error) if error is not None else "rank 0 could not write the manifest or the pointer"
        raise CheckpointError(
            f"--save={root}: publishing iteration {iteration} failed ({reason}); the previous "
            "checkpoint stays latest (an unfinished folder is removed by the next save)"
        )
    return layout.iteration_dir(root, iteration)


def load_checkpoint(
    path: str, model: nn.Module, opt, group=None, load_optim: bool = True, load_rng: bool = True
) -> Dict[str, Any]:
    """Collective: restore a checkpoint saved on any layout and ZeRO stage into this one.

    Args:
        path: an iteration's folder (see `resolve_checkpoint` for a --load folder's latest).
        model: the model: its params' values (fp32 masters) and its other state (buffers) are restored.
        opt: the model's ZeroOptimizer: each rank reads the ranges it holds.
        group: the process group of the load (default: the whole world).
        load_optim: restore the optimizer state and scalars (else they stay fresh).
        load_rng: restore the RNG states (the same world size only).

    Returns:
        The train state `save_checkpoint` stored.
    """
    index = _index(path)
    metadata = index.state_dict_metadata
    held = opt.held_ranges()
    renamed = keys.saved_names_for(held, metadata)  # QAT's parametrized names on one side only
    held = {renamed.get(name, name): ranges for name, ranges in held.items()}
    wanted = keys.piece_keys(metadata, held, masters_only=not load_optim)
    legacy = keys.legacy_model_state_keys(metadata, held)
    request: Dict[str, Any] = {
        key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype) for key in wanted + legacy
    }
    other_state = keys.model_state(model, _held_params(opt))
    for key, tensor in other_state.items():
        if key not in metadata:
            raise CheckpointError(f"{path}: has no '{key[len(keys.MODEL_STATE) :]}' (saved from another model?)")
        request[key] = torch.empty_like(tensor)
    request[keys.TRAIN_STATE] = b""
    rng_key = keys.rng_key(_rank())
    if load_rng and rng_key in metadata:
        request[rng_key] = b""
    _verified_load(request, path, index, collective=True, group=group)
    train_state = _train_state(request, path)
    scalars = train_state["optimizer"] if load_optim else opt.scalar_state()
    pieces = keys.pieces_from_entries(request)
    for name in {keys.model_state_name(key) for key in legacy}:
        pieces[name] = keys.pieces_from_model_state({key: request[key] for key in legacy}, name)
    back = {saved: name for name, saved in renamed.items()}
    pieces = {back.get(name, name): owned for name, owned in pieces.items()}
    opt.load_state_dict({"pieces": pieces, **scalars})
    with torch.no_grad():
        for key, tensor in other_state.items():
            tensor.copy_(request[key])
    if rng_key in request and train_state["world_size"] == _world_size():
        _set_rng_state(_decoded(request[rng_key], path, "RNG state"))
    return train_state


def _held_params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def read_train_state(path: str) -> Dict[str, Any]:
    """One process, no process group: the train state of checkpoint `path` (see `save_checkpoint`).

    Args:
        path: an iteration's folder of a moezero checkpoint.
    """
    index = _index(path)
    if keys.TRAIN_STATE not in index.state_dict_metadata:
        raise CheckpointError(f"{path}: has no train state (not a moezero checkpoint)")
    request: Dict[str, Any] = {keys.TRAIN_STATE: b""}
    _verified_load(request, path, index)
    return _train_state(request, path)


def consolidate_checkpoint(path: str) -> Dict[str, torch.Tensor]:
    """One process, no process group: the full model of a checkpoint of any layout, {name: tensor}:
    fp32 masters of the trainable params (experts stacked over all global experts) and the
    non-trainable state. Raises ValueError unless the saved pieces cover every element exactly once.

    Args:
        path: an iteration's folder of a moezero checkpoint.
    """
    index = _index(path)
    metadata = index.state_dict_metadata
    model_keys = [key for key in metadata if key.startswith(keys.MODEL_STATE)]
    request: Dict[str, Any] = {
        key: torch.empty(metadata[key].size, dtype=metadata[key].properties.dtype)
        for key in keys.piece_keys(metadata, None, masters_only=True) + model_keys
    }
    request[keys.TRAIN_STATE] = b""
    _verified_load(request, path, index)
    shapes = _train_state(request, path)["param_shapes"]
    full = consolidate([{"pieces": keys.pieces_from_entries(request), "shapes": shapes}])
    return dict(full["params"], **{key[len(keys.MODEL_STATE) :]: request[key] for key in model_keys})


class CheckpointReader:
    """One process, no process group: a checkpoint of any layout read a param range at a time (an export that
    never holds the model). The files are verified once, up front; `read` then loads only the pieces it needs.

        reader = CheckpointReader(path)
        reader.train_state["param_shapes"]         # {name: global shape}
        reader.read(name, lo, hi)                  # fp32 masters of flat elements [lo, hi) of `name`
        reader.model_state()                       # the buffers (small), {name: tensor}
    """

    def __init__(self, path: str):
        self.path = path
        index = _index(path)
        request: Dict[str, Any] = {keys.TRAIN_STATE: b""}
        _verified_load(request, path, index)
        self.train_state = _train_state(request, path)
        manifest = checksums.read_manifest(path)
        if manifest is not None:  # every file now: the reads below skip the check
            files = {info.relative_path for info in (index.storage_data or {}).values()}
            problem = checksums.verify_files(path, manifest, files)
            if problem is not None:
                raise CheckpointError(f"{problem}; the checkpoint is refused")
        self._metadata = index.state_dict_metadata
        self._pieces: Dict[str, List[Tuple[Span, str]]] = {}
        self._last: Dict[str, torch.Tensor] = {}
        for key in keys.piece_keys(self._metadata, None, masters_only=True):
            name, rng = keys.piece_of(key)
            self._pieces.setdefault(name, []).append((Span.of(rng), key))

    def ranges(self, name: str) -> List[Tuple[int, ...]]:
        """The global element ranges of `name`'s saved pieces ((lo, hi), or (lo, hi, count, stride) strided)."""
        return sorted(span.as_range() for span, _ in self._pieces.get(name, []))

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        wanted_span = Span(lo, hi)
        overlapping = sorted(p for p in self._pieces.get(name, []) if intersects(p[0], wanted_span))
        wanted = [key for _, key in overlapping]
        if not set(wanted) <= set(self._last):  # keep the pieces last read: an expert stack is read expert by expert
            self._last = {
                key: torch.empty(self._metadata[key].size, dtype=self._metadata[key].properties.dtype) for key in wanted
            }
            _load(self._last, self.path)
        out = torch.empty(hi - lo, dtype=torch.float32)
        filled = torch.zeros(hi - lo, dtype=torch.bool)
        for span, key in overlapping:
            here, there = overlap(span, wanted_span)
            out[here] = self._last[key][there].to(out.dtype)  # fp32, as a slice assignment casts
            filled[here] = True
        if not bool(filled.all()):
            raise CheckpointError(f"{self.path}: its pieces of {name} do not cover elements [{lo}, {hi})")
        return out

    def model_state(self) -> Dict[str, torch.Tensor]:
        wanted = [key for key in self._metadata if key.startswith(keys.MODEL_STATE)]
        request = {
            key: torch.empty(self._metadata[key].size, dtype=self._metadata[key].properties.dtype) for key in wanted
        }
        _load(request, self.path)
        return {key[len(keys.MODEL_STATE) :]: value for key, value in request.items()}


def _train_state(request: Dict[str, Any], path: str) -> Dict[str, Any]:
    return keys.train_state_sections(_decoded(request[keys.TRAIN_STATE], path, "train state"))


def _decoded(blob: Any, path: str, what: str) -> Any:
    try:
        return keys.decode(blob)
    except safe_pickle.UnsafePickle as exc:
        raise CheckpointError(
            f"{path}: its {what} is refused, {exc} (a file made to run code?); nothing of it was run"
        ) from None
    except Exception as exc:  # unpickling damaged bytes raises anything
        raise CheckpointError(
            f"{path}: its {what} is damaged ({first_line(exc, 80)}); resume from another checkpoint with --ckpt-step N"
        ) from None


# ---- DCP calls ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    """DCP's FutureWarnings, and its note that it runs "in a single process" without a process group
    (the intent of an offline read), are not the user's business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _index(path: str):
    """The checkpoint's DCP metadata, after checking that it and every shard file it names are whole."""
    index = os.path.join(path, ".metadata")
    if not os.path.isfile(index):
        what = "does not exist" if not os.path.exists(path) else "has no .metadata (not a checkpoint folder)"
        raise CheckpointError(f"{path}: {what}")
    manifest = checksums.read_manifest(path)
    problem = checksums.verify_files(path, manifest, [".metadata"]) if manifest is not None else None
    if problem is not None:  # before a byte of it is unpickled
        raise CheckpointError(f"{problem}; the checkpoint is refused, resume from another one with --ckpt-step N")
    try:
        metadata = safe_pickle.SafeFileSystemReader(path).read_metadata()
    except safe_pickle.UnsafePickle as exc:
        raise CheckpointError(f"{index}: refused, {exc} (a file made to run code?); nothing of it was run") from None
    except Exception as exc:  # a damaged pickle raises whatever its bytes decode to
        raise CheckpointError(
            f"{index}: unreadable, the file is damaged ({first_line(exc, 80)}); resume from "
            "another checkpoint with --ckpt-step N"
        ) from None
    _check_shard_files(path, metadata.storage_data or {})
    return metadata


def _verified_load(request: Dict[str, Any], path: str, index, collective: bool = False, group=None) -> None:
    """`_load`, after checking the files it reads (and the index) against the checkpoint's manifest.
    `collective` (a resume: every rank of `group` calls it): every rank raises the same CheckpointError when
    any rank found a mismatch, agreed before DCP's collective read."""
    manifest = checksums.read_manifest(path)
    problem = None
    if manifest is not None:
        files = {info.relative_path for item, info in (index.storage_data or {}).items() if item.fqn in request}
        problem = checksums.verify_files(path, manifest, files)  # .metadata: by _index, before it was read
    problem = next((p for p in (_gathered(problem, group) if collective else [problem]) if p), None)
    if problem is not None:
        raise CheckpointError(f"{problem}; the checkpoint is refused, resume from another one with --ckpt-step N")
    _load(request, path, collective=collective, group=group)


def _check_shard_files(path: str, storage: Dict[Any, Any]) -> None:
    """Each .distcp file exists and is at least as long as the entries the index places in it."""
    needed: Dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size is None or size < length:
            state = "is missing" if size is None else f"is truncated ({size:,} of {length:,} bytes)"
            raise CheckpointError(
                f"{file}: {state}; the checkpoint is incomplete, resume from another one with --ckpt-step N"
            )


def _load(request: Dict[str, Any], path: str, collective: bool = False, group=None) -> None:
    """Fill `request` in place from `path`, reading only its keys; `collective`: every rank of `group`
    calls it (a resume), else this process reads alone (offline, or each rank on its own). DCP gathers a
    failed read from every rank, so all raise the same CheckpointError."""
    try:
        with _quiet():
            dcp.load(
                request,
                storage_reader=safe_pickle.SafeFileSystemReader(path),
                planner=safe_pickle.SafeLoadPlanner(allow_partial_load=True),
                no_dist=not (collective and dist.is_initialized()),
                process_group=group,
            )
    except (Exception, CheckpointException) as exc:  # DCP's (a BaseException) gathers every rank's error
        raise CheckpointError(
            f"{path}: reading it failed, the shard files are damaged ({innermost_cause(exc)}); "
            "resume from another checkpoint with --ckpt-step N"
        ) from None


# ---- ranks and RNG -----------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gathered(value: Any, group) -> list:
    """Every rank's `value` (collective), or [value] without a process group."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _all_ok(ok: bool, group) -> bool:
    """Collective over `group`, the whole world where None (as _barrier): whether `ok` holds on every rank."""
    if not dist.is_initialized():
        return ok
    return comm.all_true(ok, group if group is not None else dist.group.WORLD)


def _rng_state() -> Dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
