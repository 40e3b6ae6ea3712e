"""A Hugging Face model directory on disk: config.json and safetensors shards with their index.

Reading is lazy: a tensor is read from its shard when asked for (safetensors maps the file, one file at a time),
so a rank reads only what it holds and keeps no more than one file's pages mapped. FP8 weights with 128x128-block
scales (DeepSeek-V3's published checkpoints, `weight_scale_inv`) and MXFP4 expert stacks (GPT-OSS's, `X_blocks`
and `X_scales` for a tensor X) are dequantized as they are read. Writing is `moezero.hf.staged_write`'s.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List, Tuple

import torch
from safetensors import safe_open

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the files transformers' from_pretrained takes a model's weights from (PEFT's adapter too): model.safetensors,
# pytorch_model-00001-of-00002.bin, their .index.json, tf_model.h5, flax_model.msgpack; not the other files a
# folder may hold (a model.pt being exported, optimizer.pt, training_args.bin, rng_state.pth)
_WEIGHTS = re.compile(
    r"^((model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)|tf_model\.h5|"
    r"flax_model(-\d+-of-\d+)?\.msgpack)(\.index\.json)?$"
)


class CheckpointMismatch(ValueError):
    """The directory's tensors do not fit the model its config describes."""


class HubDirectory:
    """The config and the tensors of a Hub-layout directory."""

    def __init__(self, path: str):
        self.path = path
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
        self.config = _read_json(config_path)
        if not isinstance(self.config, dict):
            raise CheckpointMismatch(f"{config_path}: not a config (a JSON object is expected)")
        generation = os.path.join(path, "generation_config.json")
        self.generation_config = _read_json(generation) if os.path.isfile(generation) else None
        self._open: Dict[str, object] = {}
        self.weight_map = self._weight_map()
        self.mxfp4 = {
            k[: -len("_blocks")]
            for k in self.weight_map
            if k.endswith("_blocks") and k[: -len("_blocks")] + "_scales" in self.weight_map
        }

    def _weight_map(self) -> Dict[str, str]:
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointMismatch(f"{index}: has no weight_map")
            missing = sorted(
                {name for name in weight_map.values() if not os.path.isfile(os.path.join(self.path, str(name)))}
            )
            if missing:  # now, not at the first read of one of its tensors deep inside a training step
                more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
                raise CheckpointMismatch(
                    f"{index}: names {missing[0]}{more}, which the folder does not hold (a download or copy cut short?)"
                )
            return weight_map
        single = os.path.join(self.path, SINGLE)
        if not os.path.isfile(single):
            raise FileNotFoundError(f"{self.path}: neither {INDEX} nor {SINGLE} (moezero reads safetensors only)")
        return {key: SINGLE for key in self._open_file(SINGLE).keys()}

    def keys(self) -> Iterable[str]:
        """The tensors' keys; an MXFP4 tensor's once, under its own name (not its blocks' and scales')."""
        packed = {k + suffix for k in self.mxfp4 for suffix in ("_blocks", "_scales")}
        return [k for k in self.weight_map if k not in packed] + sorted(self.mxfp4)

    def file_of(self, key: str) -> str:
        """The path of the shard the index names for `key` (the folder where it names none)."""
        key = key + "_blocks" if key in self.mxfp4 else key
        return os.path.join(self.path, self.weight_map.get(key, ""))

    def read(self, key: str) -> torch.Tensor:
        """The tensor `key`; FP8 block-quantized weights (DeepSeek-V3's) and MXFP4 expert stacks (GPT-OSS's)
        come dequantized to fp32."""
        if key in self.mxfp4:
            return dequantize_mxfp4(self._stored(key + "_blocks"), self._stored(key + "_scales"))
        tensor = self._stored(key)
        if tensor.dtype in FP8_DTYPES:
            self._check_scale_grid(key)
            tensor = dequantize_blocks(tensor, self._stored(key + "_scale_inv"), self.block_size)
        return tensor

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `key` (dim 0), read without the rest; FP8 and MXFP4 ones dequantized."""
        if key in self.mxfp4:  # rows of dim 0 are experts: whole ones, with their scales
            return dequantize_mxfp4(self._slice(key + "_blocks")[start:stop], self._slice(key + "_scales")[start:stop])
        if not self._slice(key).get_dtype().startswith("F8"):
            return self._slice(key)[start:stop]
        self._check_scale_grid(key)
        rows = self.block_size[0]
        first = start // rows * rows  # whole blocks, so each row meets its block's scale
        weight = self._slice(key)[first:stop]
        scale = self._slice(key + "_scale_inv")[start // rows : -(-stop // rows)]
        return dequantize_blocks(weight, scale, self.block_size)[start - first :]

    def read_box(self, key: str, start: int, stop: int, col_start: int, col_stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `key`, of each the flat elements [col_start, col_stop) of its trailing dims
        (a (rows, columns) tensor): a 2-D tensor's box read without the rest; FP8 and MXFP4 ones, and tensors of
        other ranks, from their whole rows."""
        if len(self.shape(key)) == 2 and key not in self.mxfp4 and not self._slice(key).get_dtype().startswith("F8"):
            return self._slice(key)[start:stop, col_start:col_stop]
        return self.read_rows(key, start, stop).reshape(stop - start, -1)[:, col_start:col_stop]

    def shape(self, key: str) -> Tuple[int, ...]:
        if key in self.mxfp4:  # blocks (E, out, in / 32, 16 bytes) hold the stack (E, in, out)
            experts, out, groups, nbytes = self._slice(key + "_blocks").get_shape()
            return experts, groups * nbytes * 2, out
        return tuple(self._slice(key).get_shape())

    @property
    def block_size(self) -> Tuple[int, int]:
        """The FP8 tiles (transformers' FineGrainedFP8Config default, 128 x 128, where the config gives none)."""
        quantization = self.config.get("quantization_config") or {}
        return tuple(quantization.get("weight_block_size") or (128, 128))

    def _check_scale_grid(self, key: str) -> None:
        """An FP8 weight's scales must tile it in `block_size` blocks: one line naming file and key otherwise
        (a wrong or missing weight_block_size would dequantize with the wrong scales)."""
        rows, cols = self.shape(key)
        expected = (-(-rows // self.block_size[0]), -(-cols // self.block_size[1]))
        grid = self.shape(key + "_scale_inv")
        if tuple(grid) != expected:
            file = os.path.join(self.path, self.weight_map[key])
            raise CheckpointMismatch(
                f"{file}: {key} is an FP8 {rows} x {cols} "
                f"weight whose scales are a {' x '.join(map(str, grid))} grid, not the "
                f"{expected[0]} x {expected[1]} its {self.block_size[0]} x {self.block_size[1]} blocks "
                "need (config.json quantization_config.weight_block_size)"
            )

    def _stored(self, key: str) -> torch.Tensor:
        return self._read(key, lambda f: f.get_tensor(key))

    def _slice(self, key: str):
        return self._read(key, lambda f: f.get_slice(key))

    def _read(self, key: str, read):
        """read(the open shard of `key`); a damaged shard or a key its index names but it lacks is one
        CheckpointMismatch naming both."""
        if key not in self.weight_map:
            raise KeyError(f"{self.path}: the checkpoint has no tensor {key!r}")
        name = self.weight_map[key]
        shard = self._open_file(name)
        try:
            return read(shard)
        except Exception as exc:  # safetensors' errors carry no type of their own
            raise CheckpointMismatch(
                f"{os.path.join(self.path, name)}: cannot read {key} ({_first_line(exc)}; the "
                "index names this file for it)"
            ) from None

    def _open_file(self, name: str):
        if name not in self._open:
            # one file mapped at a time: the pages a read touched count as the process's memory until the file
            # is unmapped (its tensors are views of the mapping until their readers copy them)
            self._open.clear()
            path = os.path.join(self.path, name)
            try:
                self._open[name] = safe_open(path, "pt")
            except Exception as exc:  # a truncated or damaged file: safetensors' own error types
                raise CheckpointMismatch(f"{path}: not a readable safetensors file ({_first_line(exc)})") from None
        return self._open[name]


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as exc:
        raise CheckpointMismatch(f"{path}: not JSON ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """fp32 weight of an FP8 one stored per (block rows x block columns) tile with its scale: w * scale_inv."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


# the values of the 16 FP4 (E2M1) codes
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 expert stack (E, in, out) of MXFP4 blocks (E, out, in / 32, 16 bytes: two FP4 codes a byte, the low
    nibble first) and their scales (E, out, in / 32: a power of two, biased by 127), as OpenAI's GPT-OSS files
    hold them."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointMismatch(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit")
    codes = torch.tensor(FP4_E2M1, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    pairs = torch.stack([codes[(blocks & 0x0F).long()], codes[(blocks >> 4).long()]], dim=-1)
    values = torch.ldexp(pairs.flatten(-2), scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(-2, -1)


def weight_files(path: str) -> List[str]:
    """The names of the files in `path` a library may read weights from."""
    return sorted(n for n in os.listdir(path) if _WEIGHTS.search(n)) if os.path.isdir(path) else []
