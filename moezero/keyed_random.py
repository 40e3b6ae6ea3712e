"""Random numbers keyed by what they are for, never by a shared stream's position.

Layout invariance needs every random draw to depend only on stable keys: a parameter's init
on (seed, parameter name, global expert index); dropout and router jitter on (seed, iteration,
global sample index, site). Then one process, two processes, ep 1 or ep 2 draw the same numbers
for the same weights and samples, and activation recompute redraws the same masks for free.

Initial weights are drawn on the CPU, so a GPU run starts from the CPU's weights. Per-sample draws
(dropout masks, router jitter) are made on the device they are applied on, from that device's
generator seeded with the same key: a CPU's stream on a CPU, a GPU's (Philox) on a GPU. Drawing a
GPU's masks on its host would make the host the step (an attention mask of a 1024-token sequence
is 16M numbers per head group and sample). Layouts agree on either kind of device; the two kinds
draw different masks for the same key, and GPU models may differ among themselves (torch's CUDA
streams depend on the launch grid).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from moezero.parallel.expert_marker import expert_shard_of
from moezero.parallel.tensor_marker import tensor_shard_of


def keyed_seed(*keys) -> int:
    """A 63-bit seed that depends only on the keys (stable across processes and Python runs)."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def keyed_generator(*keys, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(keyed_seed(*keys))


def keyed_normal_(tensor: torch.Tensor, std: float, *keys) -> torch.Tensor:
    """Fill `tensor` in place from N(0, std^2) drawn in fp32 on the CPU (device- and dtype-independent)."""
    values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=keyed_generator(*keys))
    with torch.no_grad():
        tensor.copy_(values)
    return tensor


def init_keyed_(
    module: nn.Module, seed: int, std_for: Callable[[str, torch.Tensor], Optional[float]], prefix: str = ""
) -> None:
    """Initialise every parameter of `module` from keys alone.

    std_for(name, param) gives the normal std, 0.0 for zeros (biases), or None to leave the param as
    the module built it (norm weights). A routed-expert tensor is filled one local expert at a time,
    each keyed by its *global* expert index, so ep does not change any expert's initial weights.
    """
    for name, param in module.named_parameters():
        full_name = prefix + name
        std = std_for(full_name, param)
        if std is None:
            continue
        if std == 0.0:
            with torch.no_grad():
                param.zero_()
            continue
        shard = expert_shard_of(param)
        if shard is None:
            keyed_normal_(param, std, seed, full_name)
            continue
        tensor_shard = tensor_shard_of(param)
        for local in range(shard.num_local_experts):
            if tensor_shard is None:
                keyed_normal_(param[local], std, seed, full_name, shard.global_index(local))
                continue
            # an ETP slice: the whole expert drawn, the slice kept, so every etp gives it the same values
            item = tensor_shard.item_shard()
            whole = keyed_normal_(torch.empty(item.global_shape), std, seed, full_name, shard.global_index(local))
            with torch.no_grad():
                param[local].copy_(item.local_of(whole))


def is_bias(name: str) -> bool:
    """A linear layer's bias (`.bias`, an expert stack's `b1` / `b2`): zero at init, as Megatron's; not the
    router's, which megatron-core initialises as its weight (N(0, init_method_std))."""
    return name.endswith(("bias", ".b1", ".b2")) and not name.endswith("router.wg.bias")


@dataclass(frozen=True)
class SampleKeys:
    """Keys for per-sample random draws in one micro-batch: (seed, iteration, global sample index).

    `sample_ids` are the global indices of the micro-batch's samples, in batch order.
    """

    seed: int
    iteration: int
    sample_ids: tuple

    def _per_sample(self, site: str, shape, draw, device) -> torch.Tensor:
        """(B, *shape) fp32 on `device`: sample b's numbers from its own generator on that device."""
        device = torch.device(device)
        out = torch.empty((len(self.sample_ids),) + tuple(shape), dtype=torch.float32, device=device)
        for row, sample in zip(out, self.sample_ids):
            draw(row, keyed_generator(self.seed, self.iteration, int(sample), site, device=device))
        return out

    def uniform(
        self, site: str, shape_per_sample, low: float, high: float, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """(B, *shape) uniform numbers in [low, high), one independent stream per sample."""
        return self._per_sample(site, shape_per_sample, lambda t, g: t.uniform_(low, high, generator=g), device)

    def normal(self, site: str, shape_per_sample, device: torch.device | str = "cpu") -> torch.Tensor:
        """(B, *shape) standard normal numbers, one independent stream per sample."""
        return self._per_sample(site, shape_per_sample, lambda t, g: t.normal_(generator=g), device)

    def dropout_mask(self, site: str, shape_per_sample, p: float, device: torch.device | str = "cpu") -> torch.Tensor:
        """(B, *shape) keep-mask already scaled by 1/(1-p), as nn.Dropout applies it."""
        uniform = self._per_sample(site, shape_per_sample, lambda t, g: t.uniform_(0.0, 1.0, generator=g), device)
        return (uniform >= p).to(torch.float32) / (1.0 - p)


def keyed_dropout(x: torch.Tensor, p: float, training: bool, keys: Optional[SampleKeys], site: str) -> torch.Tensor:
    """Dropout on x shaped (B, ...) whose mask depends only on the keys (torch's RNG without keys)."""
    if not training or p == 0.0:
        return x
    if keys is None:
        return nn.functional.dropout(x, p, training=True)
    mask = keys.dropout_mask(site, x.shape[1:], p, device=x.device).to(dtype=x.dtype)
    return x * mask
