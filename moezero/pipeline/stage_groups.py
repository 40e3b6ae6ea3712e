"""The process groups of a pipeline rank: its stage's dp/ep/edp groups as a `ParallelGroups`, its pipeline (pp)
group, and a world-level control group.

Built from Megatron's partitions (`ranks.py`, at tp = 1): every group of every partition is created on every rank in
one order (torch's new_group is collective over the world), each rank keeping its own. The stage's groups are a
`ParallelGroups` over the stage's ranks in stage-local coordinates: its `rank` is this rank's place in its dp group
(Megatron's dp-cp: cp fastest), its layout that of a world of dp_size ranks with the run's ep and cp, so the MoE
layers, the cp exchanges, the ZeRO families (dense over dp-cp, experts over edp), the step totals and the
agreement records all work per stage unchanged. With tensor parallelism (tp > 1) the stage's ranks are its tp-dp-cp
group, its `ParallelGroups` that of a world of the stage's size at the run's tp (`dp` and `control` the dp-cp group
of the rank's tp coordinate, as at pp 1, `tp` its tp group): each tp coordinate has pipelines and an embedding group
of its own. At etp > 1 its `etp` is the stage's expert tensor-parallel group (Megatron's expert folding). Its
agreement group (gloo, the stage's ranks) is given at construction: `ParallelGroups.agreement_group()` would make
one over ranks 0..dp_size-1 of the world; so is its batch agreement group (gloo, the stage's tp-cp group: the ranks
reading the same micro-batches, None at tp = cp = 1). Records and short all-reduces travel on gloo (no local pipes yet).

    groups = PipelineGroups.build(pipeline_parallel_size=2, expert_parallel_size=1, context_parallel_size=1)
    groups.stage   # ParallelGroups of this rank's stage
    groups.pp      # this rank's pipeline, stage order (None once closed after a failure)
"""

from __future__ import annotations

import datetime
import gc
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from moezero.parallel import ParallelGroups
from moezero.parallel.groups import RankLayout, rank_layout
from moezero.pipeline.ranks import Partition, PipelineRankLayout, pipeline_rank_layout


class PipelineGroups:
    """This rank's groups: `stage` (ParallelGroups), `pp`, `world_control`; coordinates from `layout`."""

    def __init__(
        self,
        layout: PipelineRankLayout,
        rank: int,
        stage: ParallelGroups,
        pp: Optional[Any],
        world_control: Optional[Any],
        timeout: Optional[datetime.timedelta] = None,
        embedding: Optional[Any] = None,
    ):
        self.layout, self.rank, self.stage = layout, rank, stage
        self._pp = pp
        self._embedding = embedding
        self.world_control = world_control
        self.timeout = timeout

    @property
    def pp(self) -> Optional[Any]:
        return self._pp

    @property
    def embedding(self) -> Optional[Any]:
        """Megatron's embedding group of this rank's pipeline (its first and last rank: the tied word embedding's
        two copies); None on a middle stage, or once closed after a failure."""
        return self._embedding

    @property
    def embedding_ranks(self) -> Tuple[int, ...]:
        return self.layout.group_of(self.layout.embedding_groups, self.pp_ranks[0])

    @property
    def pp_size(self) -> int:
        return self.layout.pipeline_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank_of(self.rank)

    @property
    def pp_ranks(self) -> Tuple[int, ...]:
        """This rank's pipeline, by stage (global ranks)."""
        return self.layout.group_of(self.layout.pp_groups, self.rank)

    @property
    def dp_size(self) -> int:
        """The ranks reducing the stage's dense gradients with this rank (Megatron's dp-cp, its tp coordinate's)."""
        return len(self.layout.group_of(self.layout.dp_groups, self.rank))

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank_of(self.rank)

    @property
    def data_parallel_size(self) -> int:
        """Ranks of a stage that read distinct micro-batches (Megatron's dp: a cp group's read the same)."""
        return self.dp_size // self.layout.context_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank_of(self.rank)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @classmethod
    def build(
        cls,
        pipeline_parallel_size: int,
        expert_parallel_size: int = 1,
        use_tp_pp_dp_mapping: bool = False,
        timeout: Optional[datetime.timedelta] = None,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
    ) -> "PipelineGroups":
        """Create the groups; every rank calls this in the same order (after init_process_group). Raises
        ConfigError (one line) for sizes Megatron refuses."""
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = pipeline_rank_layout(
            world,
            expert_parallel_size,
            pipeline_parallel_size,
            use_tp_pp_dp_mapping,
            context_parallel_size,
            tensor_parallel_size,
            expert_tensor_parallel_size,
        )
        dp = _own_group(layout.dp_groups, rank, timeout)
        control = _own_group(layout.dp_groups, rank, timeout)  # the optimizer's: it adds the sums over tp itself
        agreement = _own_group(layout.stage_groups, rank, timeout, backend="gloo")
        ep = _own_group(layout.ep_groups, rank, timeout)
        edp = _own_group(layout.edp_groups, rank, timeout)
        cp = _own_group(layout.cp_groups, rank, timeout) if context_parallel_size > 1 else None
        tp = _own_group(layout.tp_groups, rank, timeout) if tensor_parallel_size > 1 else None
        etp = _own_group(layout.etp_groups, rank, timeout) if expert_tensor_parallel_size > 1 else None
        shared_batches = context_parallel_size * tensor_parallel_size > 1
        batch = _own_group(layout.batch_groups, rank, timeout, backend="gloo") if shared_batches else None
        pp = _own_group(layout.pp_groups, rank, timeout)
        embedding = _own_group(layout.embedding_groups, rank, timeout)
        world_control = dist.new_group(list(range(world)), timeout=timeout)
        stage = stage_parallel_groups(
            layout,
            rank,
            dp=dp,
            ep=ep,
            edp=edp,
            cp=cp,
            tp=tp,
            etp=etp,
            control=control,
            agreement=agreement,
            batch=batch,
            timeout=timeout,
        )
        return cls(layout, rank, stage, pp, world_control, timeout, embedding)

    def sum_over_stages(self, tensor: torch.Tensor) -> None:
        """All-reduce (sum) `tensor` in place over this rank's pipeline: a total of every stage's part. The group is
        read here, never kept (close_pp)."""
        group = self._pp
        if group is None:
            raise RuntimeError("this rank's pipeline group was closed after a stage failed; the run cannot go on")
        dist.all_reduce(tensor, group=group)

    def close_pp(self) -> None:
        """Close this rank's pipeline connections (after a failure): a neighbour blocked in a send or receive
        with this rank fails at once ("connection closed") instead of waiting for the group's timeout. gloo's
        abort() leaves the connections open; they close when the last reference to the group goes, so every
        holder (the schedules' stages) must have dropped it first."""
        for name in ("_pp", "_embedding"):  # the embedding group: a neighbour may wait in the tied sum
            group = getattr(self, name)
            setattr(self, name, None)
            if group is not None:
                dist.destroy_process_group(group)
            del group
        gc.collect()

    def destroy(self) -> None:
        """Release every group (tests create many)."""
        self.close_pp()
        self.stage.destroy()
        if self.world_control is not None:
            dist.destroy_process_group(self.world_control)
            self.world_control = None


def stage_parallel_groups(
    layout: PipelineRankLayout,
    rank: int,
    *,
    dp: Any,
    ep: Any,
    edp: Any,
    control: Any,
    agreement: Any,
    batch: Optional[Any] = None,
    timeout: Optional[datetime.timedelta] = None,
    cp: Optional[Any] = None,
    tp: Optional[Any] = None,
    etp: Optional[Any] = None,
) -> ParallelGroups:
    """A `ParallelGroups` for this rank's stage, in stage-local coordinates (see the module's docstring)."""
    local, me = stage_coordinates(layout, rank)
    return ParallelGroups(
        local,
        me,
        dp=dp,
        ep=ep,
        edp=edp,
        cp=cp,
        tp=tp,
        etp=etp,
        control=control,
        timeout=timeout,
        local_records=False,
        _lazy={"agreement": agreement, "batch": batch},
    )


def stage_coordinates(layout: PipelineRankLayout, rank: int) -> Tuple[RankLayout, int]:
    """(the layout of a world of the stage's size with the run's ep, cp, tp and etp, this rank's place in its stage),
    checking that the stage-local ep/edp/cp/tp/etp/dp-cp groups, mapped to global ranks through the stage's ranks, are
    Megatron's (pure)."""
    members = layout.group_of(layout.stage_groups, rank)
    tp = layout.tensor_parallel_size
    etp = layout.expert_tensor_parallel_size
    local = rank_layout(len(members), layout.expert_parallel_size, layout.context_parallel_size, tp, etp)
    me = members.index(rank)
    for name, partition, expected in (
        ("ep", layout.ep_groups, local.ep_group_of(me)),
        ("edp", layout.edp_groups, local.edp_group_of(me)),
        ("cp", layout.cp_groups, local.cp_group_of(me)),
        ("tp", layout.tp_groups, local.tp_group_of(me)),
        ("etp", layout.etp_groups, local.etp_group_of(me)),
        ("dp-cp", layout.dp_groups, local.dense_group_of(me)),
    ):
        mapped = tuple(members[i] for i in expected)
        if layout.group_of(partition, rank) != mapped:
            raise AssertionError(
                f"the {name} group of rank {rank} is {layout.group_of(partition, rank)}, its stage's "
                f"layout gives {mapped}"
            )
    return local, me


def _own_group(
    partition: Partition, rank: int, timeout: Optional[datetime.timedelta], backend: Optional[str] = None
) -> Any:
    """Every rank creates every group of the partition (new_group is collective); keep this rank's."""
    mine = None
    for members in partition:
        group = dist.new_group(list(members), timeout=timeout, backend=backend)
        if rank in members:
            mine = group
    return mine
