"""A small model with every gradient path that has broken ZeRO implementations, and its data.

- MoE layers whose experts often get no tokens (2 x 3 tokens, top-2 of 8 experts per micro-batch)
- a branch skipped on odd steps, and a branch used only when a micro-batch's data says so
- tied input/output embeddings, a param used twice, a frozen param
- a non-reentrant activation-checkpointed block
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.keyed_random import init_keyed_
from moezero.moe import MoEConfig, MoELayer

VOCAB, HIDDEN, SEQ, BATCH = 16, 8, 3, 2


class ZeroTestModel(nn.Module):
    def __init__(self, groups, num_experts=8, top_k=2, seed=5):
        super().__init__()
        cfg = MoEConfig(hidden_size=HIDDEN, ffn_hidden_size=12, num_experts=num_experts, top_k=top_k,
                        aux_loss_coeff=0.05, z_loss_coeff=1e-3)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.moe1 = MoELayer(cfg, groups, layer_number=1)
        self.twice = nn.Linear(HIDDEN, HIDDEN)
        self.odd_step_branch = nn.Linear(HIDDEN, HIDDEN)
        self.data_branch = nn.Linear(HIDDEN, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.moe2 = MoELayer(cfg, groups, layer_number=2)
        self.norm = nn.LayerNorm(HIDDEN)
        init_keyed_(self, seed, lambda name, p: None if "norm" in name else 0.3)

    def forward(self, tokens, targets, step):
        x = self.embed(tokens)
        x = x + checkpoint(self.block, x, use_reentrant=False)
        y, stats1 = self.moe1(x)
        x = x + y
        x = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        if step % 2 == 0:
            x = x + self.odd_step_branch(x)
        if int(tokens[0, 0]) % 2 == 0:
            x = x + self.data_branch(x)
        x = x + self.frozen(x)
        y, stats2 = self.moe2(x)
        x = self.norm(x + y)
        logits = x @ self.embed.weight.t()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).double(), targets.reshape(-1))
        return loss + stats1.aux_loss + stats1.z_loss + stats2.aux_loss + stats2.z_loss


def micro_batch(step, index):
    """Global micro-batch `index` of `step`: the same on every layout."""
    g = torch.Generator().manual_seed(step * 1000 + index)
    seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]
