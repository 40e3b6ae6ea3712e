"""Multi-token prediction (DeepSeek-V3's MTP, as Megatron's MultiTokenPredictionBlock builds it).

D modules follow the decoder; module k (0-based) sees the tokens shifted left by k+1 and predicts, at
position i, the token i+k+2:

    h_k = final_norm_k(layer_k(eh_proj_k([enorm_k(embed(tokens shifted by k+1)), hnorm_k(h_{k-1})])))

h_-1 is the decoder's output after its final norm; `embed` and the output layer are the model's own. A shift
moves left and lets zeros in at the end, as Megatron's roll_tensor does; the labels and loss mask shift the same
way, so the positions past the sequence's end count for nothing. The loss is Megatron's: the training loss adds
mtp_loss_scaling_factor x the mean over depths of each depth's masked token mean.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.config import GPTConfig
from moezero.keyed_random import SampleKeys, keyed_dropout
from moezero.models.attention import norm_layer
from moezero.moe import MoEStats


def shift_left(tensor_BS: torch.Tensor, places: int = 1) -> torch.Tensor:
    """Each row moved `places` positions left, zeros in at the end (Megatron's roll_tensor, `places` times)."""
    out = torch.zeros_like(tensor_BS)
    if places < tensor_BS.shape[-1]:
        out[..., : tensor_BS.shape[-1] - places] = tensor_BS[..., places:]
    return out


def recomputes_mtp(config: GPTConfig) -> bool:
    """Megatron recomputes the MTP depths with --recompute-granularity full --recompute-method uniform."""
    return config.recompute_granularity == "full" and config.recompute_method == "uniform"


def run_mtp_depth(
    k: int,
    depth: nn.Module,
    embedding: nn.Module,
    tokens_BS: torch.Tensor,
    hidden: torch.Tensor,
    keys: Optional[SampleKeys],
    config: GPTConfig,
    training: bool,
    recompute: bool,
    shifted_tokens_BS: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[MoEStats]]:
    """MTP depth k (`depth`) on the previous depth's `hidden`: the tokens shifted k + 1 places (`shifted_tokens_BS`
    when given: a context-parallel rank's, shifted before the split), embedded with `embedding` and its keyed
    dropout, then the depth (checkpointed when `recompute`); (hidden, its MoE stats)."""
    shifted = shift_left(tokens_BS, k + 1) if shifted_tokens_BS is None else shifted_tokens_BS
    embedded = keyed_dropout(embedding(shifted), config.hidden_dropout, training, keys, f"mtp{k}.embedding")
    if recompute:
        return checkpoint(depth, embedded, hidden, keys, use_reentrant=False)
    return depth(embedded, hidden, keys)


class MultiTokenPredictionLayer(nn.Module):
    """One depth: the two norms and the projection of their concatenation, a transformer layer (`layer`, built
    by the model as its own layers are) and the depth's final norm."""

    def __init__(self, config: GPTConfig, layer: nn.Module):
        super().__init__()
        self.enorm = norm_layer(config)
        self.hnorm = norm_layer(config)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = layer
        self.final_norm = norm_layer(config)

    def forward(
        self, embedded_BSD: torch.Tensor, hidden_BSD: torch.Tensor, keys: Optional[SampleKeys]
    ) -> Tuple[torch.Tensor, Optional[MoEStats]]:
        x = self.eh_proj(torch.cat([self.enorm(embedded_BSD), self.hnorm(hidden_BSD)], dim=-1))
        x, stats = self.layer(x, keys)
        return self.final_norm(x), stats


def mtp_losses(
    logits: List[torch.Tensor], labels_BS: torch.Tensor, loss_mask_BS: torch.Tensor, loss_fn
) -> List[torch.Tensor]:
    """Each depth's loss: `loss_fn(logits, labels, mask)` with the labels and mask shifted k+1 places."""
    return [
        loss_fn(depth_logits, shift_left(labels_BS, k + 1), shift_left(loss_mask_BS, k + 1))
        for k, depth_logits in enumerate(logits)
    ]
