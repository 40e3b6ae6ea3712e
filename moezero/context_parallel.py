"""Context parallelism (Megatron's --context-parallel-size): the ranks of a cp group share one micro-batch, each
holding a part of every sequence (at tp > 1 each tp rank its heads of it, or under sequence parallelism its shard;
training/tensor_parallel.py).

Split (megatron.core.utils.get_batch_on_this_cp_rank): a sequence of S tokens is cut into 2 cp chunks and cp rank r
keeps chunks r and 2cp-1-r (cp 2, S 8: rank 0 positions [0, 1, 6, 7], rank 1 [2, 3, 4, 5]), which balances the
causal attention's work. Everything defined on the whole sequence (MTP's token shifts, the loss tokens) is computed
before the split.

Attention: every rank's queries see the keys and values of every earlier global position. --cp-comm-type
all_gather: they are all-gathered over the cp group in forward (put back into global order) and their gradients
reduce-scattered in backward (`gather_sequence`); masks, RoPE, learned positions and keyed dropout take the rank's
global positions. a2a (Ulysses): an all-to-all trades the rank's part of the sequence of every head for the whole
sequence of its 1/cp of the heads (`heads_to_sequence`), attention runs there as in one process, and a second
all-to-all trades back (`sequence_to_heads`). Megatron's p2p (a ring with an online softmax) computes the same
attention as the all-gather and overlaps only on GPUs: it runs the all-gather here, and the run's log says so.

Shapes: B batch, S sequence (Sl: this rank's part), D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from moezero.keyed_random import SampleKeys
from moezero.models.mtp import shift_left
from moezero.parallel import comm
from moezero.parallel.groups import SharesProcessGroups

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def chunk_positions(sequence_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions cp rank `cp_rank` holds: chunks cp_rank and 2 cp_size - 1 - cp_rank of 2 cp_size."""
    chunk = sequence_length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def split_sequence(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """`tensor`'s positions along `dim` that cp rank `cp_rank` holds, in order."""
    if cp_size == 1:
        return tensor
    positions = chunk_positions(tensor.shape[dim], cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(dim, positions)


class ShardedSampleKeys(SampleKeys):
    """Sample keys of a cp rank: each per-token draw is the slice of the whole sequence's draw at this rank's
    positions, so dropout masks, router jitter and random logits do not depend on the layout. The sequence is the
    first dimension of each sample's shape."""

    def __init__(self, keys: SampleKeys, positions: torch.Tensor, sequence_length: int):
        super().__init__(keys.seed, keys.iteration, keys.sample_ids)
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "sequence_length", sequence_length)

    def _per_sample(self, site: str, shape, draw, device) -> torch.Tensor:
        whole = super()._per_sample(site, (self.sequence_length, *tuple(shape)[1:]), draw, device)
        return whole.index_select(1, self.positions.to(whole.device))


@dataclass(frozen=True)
class HeadBlockKeys:
    """Attention-dropout keys of a2a: the whole sequence's (B, heads, S, S) mask at a block of the heads."""

    whole: SampleKeys
    heads: int
    block: slice

    def dropout_mask(self, site: str, shape_per_sample, p: float, device: torch.device | str = "cpu") -> torch.Tensor:
        _, queries, keys = shape_per_sample
        return self.whole.dropout_mask(site, (self.heads, queries, keys), p, device)[:, self.block]

    def of_block(self, block: slice) -> "HeadBlockKeys":
        """The keys of `block` of these heads (a2a's block of a tp rank's heads: a block of the global heads)."""
        start = self.block.start + block.start
        return HeadBlockKeys(self.whole, self.heads, slice(start, start + block.stop - block.start))


@dataclass(frozen=True)
class QueryRowKeys:
    """Attention-dropout keys of a cp rank's queries (all_gather): the mask `keys` draw for the whole sequence
    (B, heads, S, S) (every head's, or a tp rank's block of them: HeadBlockKeys) at this rank's query rows."""

    keys: Any
    positions: torch.Tensor
    sequence_length: int

    def query_rows_dropout_mask(self, site: str, heads: int, p: float, device) -> torch.Tensor:
        """(B, heads, Sl, S) keep-mask of this rank's queries."""
        S = self.sequence_length
        mask = self.keys.dropout_mask(site, (heads, S, S), p, device)
        return mask.index_select(2, self.positions.to(mask.device))


class ContextParallel(SharesProcessGroups):
    """This rank's place in its cp group and the exchanges attention needs (`group` None: cp 1, nothing to do).

    Args:
        group: the cp group (ParallelGroups.cp).
        comm_types: --cp-comm-type, one per layer or one for all (each runs the all-gather, see the module).
    """

    def __init__(self, group: Optional[Any], comm_types: Sequence[str] = ("p2p",)):
        self.group = group
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)
        self.comm_types = tuple(comm_types)
        self._positions: Dict[Tuple[int, str], torch.Tensor] = {}

    def positions(self, local_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of this rank's `local_length` tokens."""
        key = (local_length, str(device))
        if key not in self._positions:
            self._positions[key] = chunk_positions(local_length * self.size, self.size, self.rank).to(device)
        return self._positions[key]

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every cp rank's part of `x` along `dim`, in global order (autograd: backward sums the gradients over
        the group and keeps this rank's part)."""
        if self.size == 1:
            return x
        return _GatherSequence.apply(x, dim, self)

    def comm_type(self, layer_number: int) -> str:
        """Layer `layer_number`'s exchange: its --cp-comm-type (one for all, or one per layer; MTP layers, after
        the decoder's, take the last layer's), p2p run as all_gather."""
        kind = self.comm_types[min(layer_number, len(self.comm_types) - 1)]
        return "a2a" if kind == "a2a" else "all_gather"

    def heads_to_sequence(self, x_BNSh: torch.Tensor) -> torch.Tensor:
        """(B, N, Sl, h) of N heads at this rank's positions -> (B, N/cp, S, h): head block `rank` of the whole
        sequence, in global order (autograd: the reverse exchange in backward)."""
        B, N, Sl, h = x_BNSh.shape
        if N % self.size:
            raise ValueError(f"--cp-comm-type a2a: {N} heads do not split over {self.size} cp ranks")
        blocks = x_BNSh.reshape(B, self.size, N // self.size, Sl, h).transpose(0, 1)  # block j goes to rank j
        rows = self._all_to_all(blocks.reshape(self.size * B, N // self.size, Sl, h))
        pieces = rows.view(self.size, B, N // self.size, Sl, h).permute(1, 2, 0, 3, 4)  # rank i's positions
        gathered = pieces.reshape(B, N // self.size, self.size * Sl, h)
        return gathered.index_select(2, self._global_order(Sl, x_BNSh.device))

    def sequence_to_heads(self, y_BnSh: torch.Tensor) -> torch.Tensor:
        """The inverse of heads_to_sequence: (B, N/cp, S, h) -> (B, N, Sl, h)."""
        B, n, S, h = y_BnSh.shape
        Sl = S // self.size
        pieces = y_BnSh.index_select(2, _gathered_positions(self, Sl, y_BnSh.device))  # rank i's positions i-th
        blocks = pieces.view(B, n, self.size, Sl, h).permute(2, 0, 1, 3, 4).reshape(self.size * B, n, Sl, h)
        rows = self._all_to_all(blocks).view(self.size, B, n, Sl, h)  # head block j from rank j
        return rows.transpose(0, 1).reshape(B, self.size * n, Sl, h)

    def head_block(self, heads: int) -> slice:
        """This rank's heads of `heads` under a2a."""
        n = heads // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def head_block_keys(self, keys: Optional[SampleKeys], heads: int) -> Optional[HeadBlockKeys]:
        """a2a: the whole sequence's attention keys (`attention_keys`) at this rank's block of `heads`."""
        return None if keys is None else HeadBlockKeys(keys, heads, self.head_block(heads))

    def _all_to_all(self, rows: torch.Tensor) -> torch.Tensor:
        splits = [rows.shape[0] // self.size] * self.size
        return comm.all_to_all(rows, splits, splits, self.group)

    def _global_order(self, local_length: int, device) -> torch.Tensor:
        """Indices putting the rows of every rank's `local_length` positions (rank order) in global order."""
        return torch.argsort(_gathered_positions(self, local_length, device))

    def attention_keys(self, keys: Optional[SampleKeys]) -> Optional[SampleKeys]:
        """The keys attention's masks are drawn from: the whole sequence's (of `keys`, a rank's part or a tensor
        parallel rank's shard of it), sliced at the queries' rows (`query_row_keys`) or heads after."""
        return None if keys is None else SampleKeys(keys.seed, keys.iteration, keys.sample_ids)

    def query_row_keys(self, keys: Optional[Any], local_length: int) -> Optional[QueryRowKeys]:
        """all_gather: `keys` (whole-sequence attention keys) at this rank's `local_length` query rows."""
        if keys is None:
            return None
        return QueryRowKeys(keys, self.positions(local_length), local_length * self.size)

    def keys(self, keys: Optional[SampleKeys], local_length: int) -> Optional[SampleKeys]:
        """`keys` for this rank's positions of sequences of `local_length` tokens here."""
        if keys is None or self.size == 1:
            return keys
        return ShardedSampleKeys(keys, self.positions(local_length), local_length * self.size)

    def split_micro_batch(self, batch: Dict[str, torch.Tensor], mtp_depths: int) -> "SplitMicroBatch":
        """This rank's part of a (whole) micro-batch: tokens, labels and loss mask split, each MTP depth's shifted
        tokens, labels and mask shifted on the whole sequence and then split, and the whole micro-batch's loss
        tokens (the lm's and each depth's)."""
        split = {key: self._split(value) for key, value in batch.items() if key != "sample_index"}
        split["sample_index"] = batch["sample_index"]
        mask = batch["loss_mask"]
        whole_tokens = [mask.sum()] + [shift_left(mask, k + 1).sum() for k in range(mtp_depths)]
        if mtp_depths:
            for name, key in (("mtp_tokens", "tokens"), ("mtp_labels", "labels"), ("mtp_loss_mask", "loss_mask")):
                split[name] = torch.stack([self._split(shift_left(batch[key], k + 1)) for k in range(mtp_depths)])
        return SplitMicroBatch(split, torch.stack(whole_tokens).to(torch.float64))

    def _split(self, tensor: torch.Tensor) -> torch.Tensor:
        return split_sequence(tensor, self.size, self.rank)


@dataclass(frozen=True)
class SplitMicroBatch:
    """A cp rank's part of a micro-batch (`batch`) and the whole micro-batch's loss tokens (`whole_tokens`: the
    lm's, then each MTP depth's)."""

    batch: Dict[str, torch.Tensor]
    whole_tokens: torch.Tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dim over the cp group, in global position order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, cp: ContextParallel) -> torch.Tensor:
        ctx.dim, ctx.cp = dim, cp
        local = x.movedim(dim, 0).contiguous()
        gathered = torch.empty((cp.size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
        comm.all_gather(gathered, local, cp.group)
        order = _gathered_positions(cp, local.shape[0], x.device)
        whole = torch.empty_like(gathered)
        whole[order] = gathered
        return whole.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp, dim = ctx.cp, ctx.dim
        whole = grad.movedim(dim, 0)
        local_length = whole.shape[0] // cp.size
        order = _gathered_positions(cp, local_length, grad.device)
        pieces = whole.index_select(0, order).contiguous()  # rank j's positions at rows [j Sl, (j + 1) Sl)
        _, mine = comm.reduce_scatter_in_place(pieces.view(-1), cp.group)
        mine = mine.view(local_length, *whole.shape[1:])
        return mine.movedim(0, dim).contiguous(), None, None


def _gathered_positions(cp: ContextParallel, local_length: int, device) -> torch.Tensor:
    """The global position of each row of an all-gather of every rank's `local_length` rows."""
    length = local_length * cp.size
    return torch.cat([chunk_positions(length, cp.size, rank) for rank in range(cp.size)]).to(device)
