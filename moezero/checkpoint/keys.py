"""The DCP keys of a checkpoint, and the conversions between them and what they hold.

    optimizer/<param>/<lo>-<hi>/master     fp32 master weights of global flat elements [lo, hi) of <param>
    optimizer/<param>/<lo>-<hi>/<state>    the optimizer state of those elements (exp_avg, step, ...)
    optimizer/<param>/<lo>-<hi>x<count>s<stride>/<field>
                                           a strided piece: `count` runs of global flat elements
                                           [lo + i * stride, hi + i * stride), i < count, stored run after
                                           run as one tensor of count * (hi - lo) elements: a tensor-parallel
                                           shard along a dim >= 1 (a row-parallel weight's columns, an ETP
                                           expert's ffn slice, a fused weight's blocks), whose elements lie
                                           in one run per row of the global tensor. A rank writes at most
                                           three such pieces per block of a shard (`strided_ranges`)
    model_state/<name>[@experts<first>]    a buffer, or a param left out of the optimizer's groups (expert-
                                           parallel ones keyed by first expert; frozen params before the
                                           optimizer held them)
    train_state                            pickled dict: iteration, world_size, param_shapes (global),
                                           optimizer (scalars: param groups, loss scaler, skip counts),
                                           configs ({section: fields}), plugins ({name: state}),
                                           progress (consumed train/valid samples), tensorboard_files
                                           (the event files of the run's lineage)
    rng/rank<r>                            pickled RNG states of rank r

Routed experts are stacked over the global experts, so every element has one global coordinate
whatever the dp/ep/tp/stage layout that wrote it; a load intersects the saved pieces, plain or strided,
with the elements it holds. A plain range is a strided one of count 1 and keeps its short key.
"""

from __future__ import annotations

import pickle
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from moezero.checkpoint.safe_pickle import decode_blob
from moezero.config import upgrade_stored_configs
from moezero.parallel import expert_shard_of
from moezero.zero import Span, intersects

TRAIN_STATE = "train_state"
MODEL_STATE = "model_state/"
_PIECE = re.compile(
    r"^optimizer/(?P<name>.+)/(?P<lo>\d+)-(?P<hi>\d+)(?:x(?P<count>\d+)s(?P<stride>\d+))?/(?P<field>[^/]+)$"
)

# {"range": (lo, hi) or (lo, hi, count, stride), "master": 1-D tensor, "state": {key: tensor or scalar}}
Piece = Dict[str, Any]


def rng_key(rank: int) -> str:
    return f"rng/rank{rank}"


def piece_entries(pieces: Dict[str, List[Piece]]) -> Dict[str, torch.Tensor]:
    """{key: tensor} of an optimizer's pieces (scalars such as Adam's step become 0-d tensors)."""
    entries: Dict[str, torch.Tensor] = {}
    for name, owned in pieces.items():
        for piece in owned:
            prefix = f"optimizer/{name}/{Span.of(piece['range']).key()}"
            entries[f"{prefix}/master"] = piece["master"]
            for key, value in piece["state"].items():
                entries[f"{prefix}/{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return entries


def pieces_from_entries(entries: Dict[str, Any]) -> Dict[str, List[Piece]]:
    """The pieces among loaded entries (the inverse of `piece_entries`); other keys are ignored."""
    pieces: Dict[str, Dict[tuple, Piece]] = {}
    for key, value in entries.items():
        match = _PIECE.match(key)
        if not match:
            continue
        rng = _span(match).as_range()
        piece = pieces.setdefault(match["name"], {}).setdefault(rng, {"range": rng, "master": None, "state": {}})
        if match["field"] == "master":
            piece["master"] = value
        else:
            piece["state"][match["field"]] = value
    return {name: list(by_range.values()) for name, by_range in pieces.items()}


def piece_of(key: str) -> Tuple[str, Tuple[int, ...]]:
    """(param name, global range: (lo, hi) or (lo, hi, count, stride)) of a piece key."""
    match = _PIECE.match(key)
    return match["name"], _span(match).as_range()


def _span(match: re.Match) -> Span:
    if match["count"] is None:
        return Span(int(match["lo"]), int(match["hi"]))
    return Span(int(match["lo"]), int(match["hi"]), int(match["count"]), int(match["stride"]))


def plain_param_name(name: str) -> str:
    """A param under its plain name: a parametrized one (QAT's fake quantization) is saved under torch's
    'a.parametrizations.w.original' and is 'a.w' to a model without the parametrization."""
    return name.replace(".parametrizations.", ".").removesuffix(".original")


def saved_names_for(held: Iterable[str], keys: Iterable[str]) -> Dict[str, str]:
    """{held param name: the name a checkpoint's pieces (among `keys`) use for it}, where the two differ only by
    a parametrization (a QAT run from a plain checkpoint, or the reverse)."""
    saved = {m["name"] for m in (_PIECE.match(key) for key in keys) if m}
    by_plain = {plain_param_name(n): n for n in saved}
    return {
        name: by_plain[plain_param_name(name)]
        for name in held
        if name not in saved and plain_param_name(name) in by_plain
    }


def piece_keys(
    keys: Iterable[str], wanted: Optional[Dict[str, List[Tuple[int, ...]]]], masters_only: bool = False
) -> List[str]:
    """The piece keys among `keys` that overlap `wanted` ({param: global ranges, plain or strided}; None: every
    piece)."""
    out = []
    for key in keys:
        match = _PIECE.match(key)
        if not match or (masters_only and match["field"] != "master"):
            continue
        if wanted is None or any(intersects(_span(match), Span.of(w)) for w in wanted.get(match["name"], [])):
            out.append(key)
    return out


def model_state(model: nn.Module, held: Iterable[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """{key: tensor} of what the optimizer does not hold: the buffers, and the params left out of its
    param groups (the optimizer holds its frozen params too, with their master and state)."""
    held_ids = {id(p) for p in held}
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in held_ids:
            continue
        shard = expert_shard_of(tensor)
        key = name if shard is None else f"{name}@experts{shard.first_global_expert}"
        out[MODEL_STATE + key] = tensor.detach() if isinstance(tensor, nn.Parameter) else tensor
    return out


def model_state_name(key: str) -> str:
    """The param or buffer name of a model_state/ key."""
    return key[len(MODEL_STATE) :].partition("@experts")[0]


def legacy_model_state_keys(keys: Iterable[str], held: Dict[str, Any]) -> List[str]:
    """model_state/ keys of params the optimizer holds but the checkpoint has no pieces for."""
    keys = list(keys)
    with_pieces = {match["name"] for match in map(_PIECE.match, keys) if match}
    return [
        key
        for key in keys
        if key.startswith(MODEL_STATE) and model_state_name(key) in held and model_state_name(key) not in with_pieces
    ]


def pieces_from_model_state(entries: Dict[str, torch.Tensor], name: str) -> List[Piece]:
    """A param an older checkpoint kept under model_state/ (frozen params, before the optimizer held them)
    as optimizer pieces with fresh state: the whole tensor, or each saved expert stack at its global place."""
    pieces = []
    for key, tensor in entries.items():
        if model_state_name(key) != name:
            continue
        first = key.partition("@experts")[2]
        flat = tensor.reshape(-1)
        lo = int(first) * (flat.numel() // tensor.shape[0]) if first else 0
        pieces.append({"range": (lo, lo + flat.numel()), "master": flat, "state": {}})
    return pieces


def train_state_sections(state: Dict[str, Any]) -> Dict[str, Any]:
    """The train state with its sections. Checkpoints written before it had them kept the optimizer
    scalars at the top level and QAT's state under "qat" (now the plug-in "qat"); they still load. Their
    configs are read as the model they describe (`upgrade_stored_configs`)."""
    if state.get("configs"):
        state = dict(state, configs=upgrade_stored_configs(state["configs"]))
    if "optimizer" in state:
        return state
    scalars = ("param_groups", "loss_scaler", "skipped_steps", "consecutive_skips")
    return dict(
        state, optimizer={k: state.get(k) for k in scalars}, plugins={"qat": state["qat"]} if state.get("qat") else {}
    )


def encode(obj: Any) -> bytes:
    return pickle.dumps(obj)


def decode(blob: Any) -> Any:
    """What `encode` wrote, read by an unpickler that runs no code (safe_pickle.UnsafePickle where it would)."""
    return decode_blob(blob)
