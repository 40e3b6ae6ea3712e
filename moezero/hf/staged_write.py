"""A Hub directory written by every rank at once, swapped into place only when complete.

    staging = start_write(path, overwrite)                 # rank 0: refuses a folder holding weights
    write_shard(staging, name, {key: tensor})              # each rank, its own files
    finish_write(staging, path, config, weight_map, size)  # rank 0, once every rank wrote: index, config, swap

The staging folder sits beside the target (same file system: renames, no copies); the target then holds exactly
this write's weights (an old `model.safetensors` or a surplus shard left beside them is what transformers would
load instead), and a write that fails leaves the target as it was. A write that was killed leaves its staging
folder, which the next write into the same target removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Dict, List, Optional, Tuple, Union

import torch
from safetensors.torch import save_file

from moezero.hf.files import INDEX, weight_files
from moezero.leftovers import remove_leftovers

STAGING_PREFIX = ".moezero-export-"  # + the target folder's name + "." + mkdtemp's 8 characters


def start_write(path: str, overwrite: bool) -> str:
    """The staging folder of a write into `path`. A folder that holds weights already is refused unless
    `overwrite`, which replaces them and the old model's config and generation config (other files, such as a
    tokenizer, stay)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path}: is a file, not a folder to write a model into")
    old = weight_files(path)
    if old and not overwrite:
        raise FileExistsError(
            f"{path}: holds weights already ({', '.join(old[:3])}{', ...' if len(old) > 3 else ''}"
            "), which transformers could load instead of this export; export into a new folder, "
            "or replace them (overwrite=True, --overwrite)"
        )
    parent, base = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    _remove_unfinished(parent, base)
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{base}.", dir=parent)


def _remove_unfinished(parent: str, base: str) -> None:
    """Staging folders an interrupted write into `parent/base` left (a killed job writes no `finally`): the next
    write into the same folder removes them, as the next checkpoint save removes an unfinished `iter_N.tmp`."""
    mine = re.compile(re.escape(f"{STAGING_PREFIX}{base}.") + r"[a-z0-9_]{8}$")
    unfinished = [
        name for name in sorted(os.listdir(parent)) if mine.match(name) and os.path.isdir(os.path.join(parent, name))
    ]
    remove_leftovers(
        parent, unfinished, os.path.join(parent, base), "the staging folder of an export into it that did not finish"
    )


def write_shard(staging: str, name: str, tensors: Dict[str, torch.Tensor]) -> None:
    save_file(
        {key: t.contiguous() for key, t in tensors.items()}, os.path.join(staging, name), metadata={"format": "pt"}
    )


def finish_write(
    staging: str,
    path: str,
    config: Dict,
    weight_map: Dict[str, str],
    total_size: int,
    generation_config: Optional[Dict] = None,
    copies: Optional[Dict[str, Union[str, bytes]]] = None,
    replaced: Tuple[str, ...] = (),
) -> None:
    """The index, config.json, generation_config.json (if given) and `copies` ({name: source file, or the bytes
    to write}: the tokenizer's) into the staging folder, then its files into `path` (the old model's out, and
    with `copies` the old files of the names in `replaced`: another tokenizer's config beside the new
    tokenizer.json)."""
    try:
        for name, source in (copies or {}).items():
            if isinstance(source, bytes):
                with open(os.path.join(staging, name), "wb") as f:
                    f.write(source)
            else:
                shutil.copyfile(source, os.path.join(staging, name))
        _write_json(os.path.join(staging, INDEX), {"metadata": {"total_size": total_size}, "weight_map": weight_map})
        _write_json(os.path.join(staging, "config.json"), config)
        if generation_config is not None:
            _write_json(os.path.join(staging, "generation_config.json"), generation_config)
        os.makedirs(path, exist_ok=True)
        stale = [n for n in replaced if copies and os.path.isfile(os.path.join(path, n))]
        for name in _model_files(path) + stale:
            os.remove(os.path.join(path, name))
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(path, name))
    finally:
        abandon_write(staging)


def _write_json(path: str, value: Dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)


def abandon_write(staging: str) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def _model_files(path: str) -> List[str]:
    """What describes the model in `path`: its weights, config and generation config, a PEFT adapter's config
    (transformers would load the adapter's base model instead) (not its tokenizer)."""
    described = [
        n
        for n in ("config.json", "generation_config.json", "adapter_config.json")
        if os.path.isfile(os.path.join(path, n))
    ]
    return weight_files(path) + described
