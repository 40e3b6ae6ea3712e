"""A small model with every gradient path that has broken ZeRO implementations, and its data.

- MoE layers whose experts often get no tokens (2 x 3 tokens, top-2 of 8 experts per micro-batch)
- a branch skipped on odd steps, a branch used only when a micro-batch's data says so, and a
  branch used only for the micro-batches of one rank (`rank0_branch=True` in forward)
- tied input/output embeddings, a param used twice, a frozen param
- a non-reentrant activation-checkpointed block
- optionally (`mixed_dtypes=True`) a branch whose params stay fp32 when the rest is cast to fp64
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moezero.keyed_random import init_keyed_
from moezero.moe import MoEConfig, MoELayer

VOCAB, HIDDEN, SEQ, BATCH = 16, 8, 3, 2


class ZeroTestModel(nn.Module):
    def __init__(self, groups, num_experts=8, top_k=2, seed=5, mixed_dtypes=False):
        super().__init__()
        cfg = MoEConfig(
            hidden_size=HIDDEN,
            ffn_hidden_size=12,
            num_experts=num_experts,
            top_k=top_k,
            aux_loss_coeff=0.05,
            z_loss_coeff=1e-3,
        )
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.moe1 = MoELayer(cfg, groups, layer_number=1)
        self.twice = nn.Linear(HIDDEN, HIDDEN)
        self.odd_step_branch = nn.Linear(HIDDEN, HIDDEN)
        self.data_branch = nn.Linear(HIDDEN, HIDDEN)
        self.rank_branch = nn.Linear(HIDDEN, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.moe2 = MoELayer(cfg, groups, layer_number=2)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fp32_branch = nn.Linear(HIDDEN, HIDDEN) if mixed_dtypes else None
        init_keyed_(self, seed, lambda name, p: None if "norm" in name else 0.3)

    def _apply(self, fn, recurse=True):
        """`.double()` / `.bfloat16()` leave the fp32 branch in fp32 (two param dtypes in one model)."""
        super()._apply(fn, recurse)
        if self.fp32_branch is not None:
            self.fp32_branch.float()
        return self

    def forward(self, tokens, targets, step, rank0_branch=False):
        x = self.embed(tokens)
        x = x + checkpoint(self.block, x, use_reentrant=False)
        y, stats1 = self.moe1(x)
        x = x + y
        x = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        if step % 2 == 0:
            x = x + self.odd_step_branch(x)
        if int(tokens[0, 0]) % 2 == 0:
            x = x + self.data_branch(x)
        if rank0_branch:
            x = x + self.rank_branch(x)
        if self.fp32_branch is not None and int(tokens[0, 1]) % 2 == 0:
            x = x + self.fp32_branch(x.float()).to(x.dtype)
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


def uses_rank0_branch(index, world):
    """The rank-only branch runs for the micro-batches rank 0 reads (global index j * world + rank)."""
    return index % world == 0


class Tower(nn.Module):
    """Linear blocks in a ModuleList (stage-3 units of their own) between an embedding and a head at the root.
    `read_block_in_root`: the root's own forward reads block 1's weight after the blocks; `write_block_in_root`:
    it writes block 1's bias before them (a gather on demand, whose copy the block's forward then uses)."""

    def __init__(self, width: int, vocab: int, read_block_in_root: bool = False, write_block_in_root: bool = False):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab)
        self.read_block_in_root, self.write_block_in_root = read_block_in_root, write_block_in_root
        self.double()

    def forward(self, tokens):
        if self.write_block_in_root:
            with torch.no_grad():
                self.blocks[1].bias.add_(0.5)
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.tanh(block(x))
        logits = self.head(x)
        if self.read_block_in_root:
            logits = logits + 0.1 * self.blocks[1].weight.t().sum(0).mean()
        return logits
