"""The rank layout: which ranks form each process group, as pure partitions of the world (no processes).

Rank layout (world W, expert-parallel size ep):
  ep  groups: ep consecutive ranks            e.g. W=4, ep=2 -> {0,1} {2,3}
  edp groups: ranks with the same ep rank     e.g. W=4, ep=2 -> {0,2} {1,3}
  dp  group : every rank (dense params are replicated everywhere)
  cp  groups: cp consecutive ranks            e.g. W=4, cp=2 -> {0,1} {2,3}
Rank r has ep rank r % ep and holds global experts [ep_rank * E/ep, (ep_rank + 1) * E/ep).

Context parallelism (Megatron's order 'tp-cp-ep-dp-pp' at tp = 1): the ranks of a cp group read the same
micro-batch, each its share of the sequence; the dp group (Megatron's dp-cp) still reduces every dense gradient and
the experts fold cp into edp, as Megatron's expert groups do. `data_parallel_size` = W / cp ranks read distinct
micro-batches.

Tensor parallelism (tp > 1): Megatron's groups from parallel/ranks.py, tp fastest (world 4, tp 2: tp {0,1} {2,3},
dp {0,2} {1,3}); `dp` is the dp-cp group of the rank's tp coordinate and the tp ranks of one group read the same
micro-batch.

Expert tensor parallelism (etp > 1, Megatron's --expert-tensor-parallel-size): the experts' groups are Megatron's
expert partitions (etp fastest, then ep, then edp: world 2, etp 2: etp {0,1}, ep and edp single ranks), at any tp
(tp 1 keeps the other groups above); etp 1 builds the groups above unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from moezero.parallel.ranks import megatron_rank_layout


Ranks = Tuple[int, ...]


@dataclass(frozen=True)
class RankLayout:
    """Pure description of who talks to whom; no processes needed.

    At tensor-parallel size 1 the groups are the ones in the module's docstring. At tp > 1 they are Megatron's
    (`ranks.megatron_rank_layout`): tp fastest, `dense_groups` its dp-cp groups (the
    ranks of one tp coordinate reducing dense gradients), `data_groups` its dp groups (ranks reading distinct
    micro-batches), the experts' ep and edp folded over the same ranks (at tp 2, ep 2 the ep group {0, 1} crosses
    tp coordinates). At etp > 1 (any tp) the experts' ep, edp and etp groups are Megatron's expert partitions with
    that etp. Every rank's place is read from the partitions, never from rank arithmetic.
    """

    world_size: int
    expert_parallel_size: int
    ep_groups: Tuple[Ranks, ...]
    edp_groups: Tuple[Ranks, ...]
    context_parallel_size: int = 1
    cp_groups: Tuple[Ranks, ...] = ()  # consecutive ranks sharing one micro-batch's sequence
    tensor_parallel_size: int = 1
    tp_groups: Tuple[Ranks, ...] = ()  # ranks holding shards of one model replica (empty: singletons)
    dense_groups: Tuple[Ranks, ...] = ()  # Megatron's dp-cp: dense gradients (empty: the whole world)
    data_groups: Tuple[Ranks, ...] = ()  # Megatron's dp: ranks reading distinct micro-batches (empty: by cp stride)
    expert_tensor_parallel_size: int = 1
    etp_groups: Tuple[Ranks, ...] = ()  # ranks holding ffn slices of the same experts (empty: singletons)

    def ep_group_of(self, rank: int) -> Ranks:
        return _group_of(self.ep_groups, rank)

    def cp_group_of(self, rank: int) -> Ranks:
        return _group_of(self.cp_groups, rank) if self.cp_groups else (rank,)

    def edp_group_of(self, rank: int) -> Ranks:
        return _group_of(self.edp_groups, rank)

    def tp_group_of(self, rank: int) -> Ranks:
        return _group_of(self.tp_groups, rank) if self.tp_groups else (rank,)

    def etp_group_of(self, rank: int) -> Ranks:
        return _group_of(self.etp_groups, rank) if self.etp_groups else (rank,)

    def dense_group_of(self, rank: int) -> Ranks:
        return _group_of(self.dense_groups, rank) if self.dense_groups else tuple(range(self.world_size))

    def data_group_of(self, rank: int) -> Ranks:
        if self.data_groups:
            return _group_of(self.data_groups, rank)
        cp = self.context_parallel_size
        return tuple(range(rank % cp, self.world_size, cp))

    def batch_groups(self) -> Tuple[Ranks, ...]:
        """The ranks that read the same micro-batches (tp x cp, Megatron's tp-cp at pp 1): those at the same place
        in their data groups."""
        by_place: dict = {}
        for rank in range(self.world_size):
            by_place.setdefault(self.data_group_of(rank).index(rank), []).append(rank)
        return tuple(tuple(ranks) for ranks in by_place.values())


def _group_of(partition: Tuple[Ranks, ...], rank: int) -> Ranks:
    return next(group for group in partition if rank in group)


def rank_layout(
    world_size: int,
    expert_parallel_size: int,
    context_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
) -> RankLayout:
    """The ep/edp/cp (and at tp > 1 tp, dp-cp, dp; at etp > 1 etp) groups for a world; raises ValueError for
    impossible layouts (at tp or etp > 1 a ConfigError naming the flags, Megatron's rules)."""
    if tensor_parallel_size != 1 or expert_tensor_parallel_size != 1:
        return _megatron_layout(
            world_size, expert_parallel_size, context_parallel_size, tensor_parallel_size, expert_tensor_parallel_size
        )
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if expert_parallel_size < 1:
        raise ValueError(f"expert parallel size must be >= 1, got {expert_parallel_size}")
    if world_size % expert_parallel_size != 0:
        raise ValueError(
            f"world size ({world_size}) must be divisible by the expert parallel size ({expert_parallel_size})"
        )
    cp = context_parallel_size
    if cp < 1 or world_size % cp:
        raise ValueError(f"context parallel size {cp} must be >= 1 and divide the world size ({world_size})")
    ep = expert_parallel_size
    ep_groups = tuple(tuple(range(start, start + ep)) for start in range(0, world_size, ep))
    edp_groups = tuple(tuple(range(offset, world_size, ep)) for offset in range(ep))
    cp_groups = tuple(tuple(range(start, start + cp)) for start in range(0, world_size, cp))
    return RankLayout(world_size, ep, ep_groups, edp_groups, cp, cp_groups)


def _megatron_layout(world: int, ep: int, cp: int, tp: int, etp: int) -> RankLayout:
    """Megatron's groups at tp or etp > 1: the decoder's folding for the dense params, the experts' (etp x ep x edp
    over all ranks) for the routed experts."""
    megatron = megatron_rank_layout(world, tp, cp, ep, expert_tensor_parallel_size=etp)
    decoder, expert = megatron.decoder, megatron.expert
    return RankLayout(
        world,
        ep,
        ep_groups=expert["ep"],
        edp_groups=expert["dp"],
        context_parallel_size=cp,
        cp_groups=decoder["cp"],
        tensor_parallel_size=tp,
        tp_groups=decoder["tp"],
        dense_groups=decoder["dp-cp"],
        data_groups=decoder["dp"],
        expert_tensor_parallel_size=etp,
        etp_groups=expert["tp"],
    )
