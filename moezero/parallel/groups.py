"""Process groups for data and expert parallelism, built once and passed explicitly.

The rank layout (which ranks form each group) is layout.py's: RankLayout, rank_layout.

Each group's transport (transport.py: how its collectives travel) is chosen here, once, as the group is made.
"""

from __future__ import annotations

import copy
import datetime

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

from moezero.parallel import local_channel, local_exchange
from moezero.parallel.local_transport import LocalTransport
from moezero.parallel.layout import RankLayout, Ranks, rank_layout
from moezero.parallel.transport import Transport, release, serve

__all__ = ["ParallelGroups", "RankLayout", "SharesProcessGroups", "rank_layout"]  # the layout's, as before


@dataclass(frozen=True)
class ParallelGroups:
    """The dp, ep and edp process groups of this rank (None groups in a world of one).

    `dp` reduces dense gradients, `edp` reduces expert gradients, `ep` carries the token
    all-to-all and `control` carries the optimizer's small step-time collectives. Each is a
    distinct group object even when the members coincide, so collectives of one purpose never
    pair up with another's when ranks reach them in different orders.

    `ParallelGroups.build(expert_parallel_size)` creates them on every rank; `ParallelGroups.single()` is a
    world of one.

    Attributes:
        layout: which ranks form the ep and edp groups (`rank_layout(world_size, expert_parallel_size)`).
        rank: this process's rank in the world.
        dp: the group of all ranks, which reduces the dense gradients (None: a world of one).
        ep: this rank's expert-parallel group, which carries the tokens' all-to-all.
        edp: this rank's expert-data-parallel group (the ranks holding the same experts), which reduces the
            expert gradients.
        control: the group of all ranks for the optimizer's small step-time collectives (at tp > 1 the ranks of this
            rank's tp coordinate: the optimizer adds the sums over tp itself).
        cp: this rank's context-parallel group, the ranks sharing one micro-batch's sequence (None at cp 1).
        tp: this rank's tensor-parallel group, the ranks holding shards of one model replica (None at tp 1; `build`
            makes it with `tensor_parallel_size`, a caller may pass its own: `dataclasses.replace(groups, tp=...)`).
        etp: this rank's expert-tensor-parallel group, the ranks holding ffn slices of the same experts (None at
            etp 1; `build` makes it with `expert_tensor_parallel_size`, or a caller passes its own).
        world_control: at tp > 1 the group of every rank, for the run's decisions (None: `control` is every rank's).
        timeout: how long a collective of any group waits for a peer (None: torch's default for new groups).
        local_records: records and short all-reduces through pipes when every rank is on this host.
        transports: what serves every group's collectives (None: chosen per group, see `build`).
    """

    layout: RankLayout
    rank: int
    dp: Optional[Any] = None
    ep: Optional[Any] = None
    edp: Optional[Any] = None
    control: Optional[Any] = None
    cp: Optional[Any] = None
    tp: Optional[Any] = None
    etp: Optional[Any] = None
    world_control: Optional[Any] = None
    timeout: Optional[datetime.timedelta] = None  # every group's (None: torch's default for new groups)
    local_records: bool = True  # records and short all-reduces through pipes when every rank is on this host
    # what serves every group's collectives (None: chosen per group, see build)
    transports: Optional[Callable[[Any], Transport]] = field(default=None, compare=False, repr=False)
    _lazy: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_size(self) -> int:
        return len(self.layout.dense_group_of(self.rank))

    @property
    def ep_size(self) -> int:
        return self.layout.expert_parallel_size

    @property
    def ep_rank(self) -> int:
        return self.layout.ep_group_of(self.rank).index(self.rank)

    @property
    def edp_size(self) -> int:
        return len(self.layout.edp_group_of(self.rank))

    @property
    def edp_rank(self) -> int:
        return self.layout.edp_group_of(self.rank).index(self.rank)

    @property
    def cp_size(self) -> int:
        return self.layout.context_parallel_size

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_group_of(self.rank).index(self.rank)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else dist.get_world_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return 0 if self.tp is None else dist.get_rank(self.tp)

    @property
    def etp_size(self) -> int:
        return 1 if self.etp is None else dist.get_world_size(self.etp)

    @property
    def etp_rank(self) -> int:
        return 0 if self.etp is None else dist.get_rank(self.etp)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read distinct micro-batches (Megatron's dp; `dp_size` counts the ranks reducing dense
        gradients, Megatron's dp-cp)."""
        return len(self.layout.data_group_of(self.rank))

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.data_group_of(self.rank).index(self.rank)

    @classmethod
    def single(cls) -> "ParallelGroups":
        """A world of one: no communication anywhere."""
        return cls(rank_layout(1, 1), rank=0)

    @classmethod
    def build(
        cls,
        expert_parallel_size: int = 1,
        timeout: Optional[datetime.timedelta] = None,
        local_records: bool = True,
        transports: Optional[Callable[[Any], Transport]] = None,
        context_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
    ) -> "ParallelGroups":
        """Create the groups and their transports; every rank must call this in the same order (after
        init_process_group; without it, a world of one).

        Transports: on gloo with every rank on this host, pipes and shared-memory rings (local_transport.py);
        otherwise the backend's default (transport.py).

        Args:
            expert_parallel_size: ranks that share one copy of the experts (--expert-model-parallel-size); it
                divides the world size.
            timeout: how long a collective of any of them waits for a peer (torch's new groups do not take the
                default group's: pass the run's, e.g. --distributed-timeout-minutes).
            local_records: False: the backend's default transport even when every rank is on one host.
            transports: a transport class (or factory of one group) that serves every group instead, e.g.
                `Transport`, torch's own collectives.
            context_parallel_size: ranks that share one micro-batch's sequence (--context-parallel-size); it
                divides the world size.
            tensor_parallel_size: ranks that hold shards of one model replica (--tensor-model-parallel-size): at
                tp > 1 every group is Megatron's (RankLayout), `dp` the dp-cp group of the rank's tp coordinate.
            expert_tensor_parallel_size: ranks that hold ffn slices of the same experts
                (--expert-tensor-parallel-size, resolved: Megatron's default is tp): at etp > 1 the experts' etp, ep
                and edp groups are Megatron's expert partitions, at any tp.
        """
        if not (dist.is_available() and dist.is_initialized()):
            sizes = (("expert", expert_parallel_size), ("context", context_parallel_size))
            sizes += (("tensor", tensor_parallel_size), ("expert tensor", expert_tensor_parallel_size))
            for name, size in sizes:
                if size != 1:
                    raise ValueError(
                        f"{name} parallel size {size} needs torch.distributed to be initialised (world of one)"
                    )
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = rank_layout(
            world, expert_parallel_size, context_parallel_size, tensor_parallel_size, expert_tensor_parallel_size
        )
        if tensor_parallel_size > 1:
            return cls._build_tensor_parallel(layout, rank, timeout, local_records, transports)
        dp = dist.new_group(list(range(world)), timeout=timeout)
        control = dist.new_group(list(range(world)), timeout=timeout)
        ep = _new_subgroup(layout.ep_groups, rank, timeout)
        edp = _new_subgroup(layout.edp_groups, rank, timeout)
        cp = _new_subgroup(layout.cp_groups, rank, timeout) if context_parallel_size > 1 else None
        etp = _new_subgroup(layout.etp_groups, rank, timeout) if expert_tensor_parallel_size > 1 else None
        if transports is not None:
            for group in (dp, control, ep, edp, cp, etp):
                if group is not None:
                    serve(group, transports(group))
        elif local_records and dist.get_backend(control) == "gloo":
            _serve_local(layout, dp, control, ep, edp, timeout)
            # cp: its short all-reduces (token counts) on pipes, its K/V gathers on rings; etp: its count exchanges on
            # pipes, the experts' rows on rings
            for group, name in ((cp, "context-parallel group"), (etp, "expert tensor-parallel group")):
                if group is not None:
                    pipes = local_channel.connect(group, timeout, name)
                    _serve_local_parts(group, pipes, local_exchange.connect(group, pipes))
        return cls(
            layout,
            rank,
            dp=dp,
            ep=ep,
            edp=edp,
            control=control,
            cp=cp,
            etp=etp,
            timeout=timeout,
            local_records=local_records,
            transports=transports,
        )

    @classmethod
    def _build_tensor_parallel(
        cls,
        layout: RankLayout,
        rank: int,
        timeout: Optional[datetime.timedelta],
        local_records: bool,
        transports: Optional[Callable[[Any], Transport]],
    ) -> "ParallelGroups":
        """build() at tp > 1: every group from the layout's partitions (collective: every rank makes every group)."""
        dp = _new_subgroup(layout.dense_groups, rank, timeout)
        # the optimizer's ranks (the tp coordinate's: its sums over the model add tp afterwards), and the world's
        control = _new_subgroup(layout.dense_groups, rank, timeout)
        world_control = dist.new_group(list(range(layout.world_size)), timeout=timeout)
        ep = _new_subgroup(layout.ep_groups, rank, timeout)
        edp = _new_subgroup(layout.edp_groups, rank, timeout)
        cp = _new_subgroup(layout.cp_groups, rank, timeout) if layout.context_parallel_size > 1 else None
        tp = _new_subgroup(layout.tp_groups, rank, timeout)
        etp = _new_subgroup(layout.etp_groups, rank, timeout) if layout.expert_tensor_parallel_size > 1 else None
        named = (
            (dp, "data-parallel group"),
            (control, "control group"),
            (world_control, "world control group"),
            (ep, "expert-parallel group"),
            (edp, "expert data-parallel group"),
            (cp, "context-parallel group"),
            (tp, "tensor-parallel group"),
            (etp, "expert tensor-parallel group"),
        )
        if transports is not None:
            for group, _ in named:
                if group is not None:
                    serve(group, transports(group))
        elif local_records and dist.get_backend(control) == "gloo":
            for group, name in named:  # short all-reduces on pipes; buckets, tokens and activations on rings
                if group is not None and dist.get_world_size(group) > 1:
                    pipes = local_channel.connect(group, timeout, name)
                    rings = None
                    if group in (dp, edp):  # the buckets' exchanges, their notices on a channel of their own
                        rings = _bucket_rings(group, timeout, f"{name}'s buckets")
                    elif group in (ep, cp, tp, etp):
                        rings = local_exchange.connect(group, pipes)
                    _serve_local_parts(group, pipes, rings)
        return cls(
            layout,
            rank,
            dp=dp,
            ep=ep,
            edp=edp,
            control=control,
            cp=cp,
            tp=tp,
            etp=etp,
            world_control=world_control,
            timeout=timeout,
            local_records=local_records,
            transports=transports,
        )

    def __deepcopy__(self, memo) -> "ParallelGroups":
        return self  # a copied model talks to the same ranks (process groups cannot be copied)

    def gather_groups(self) -> Tuple[Optional[Any], Optional[Any]]:
        """(dp, edp)-shaped groups for ZeRO-3 parameter gathers, made on first use (collective: every
        rank asks in the same order). Gathers get groups of their own because they interleave with
        gradient reductions in an order that differs between ranks."""
        if "dp" not in self._lazy:
            if self.dp is None:
                self._lazy.update(dp=None, edp=None)
            else:
                dense = self.layout.dense_groups or (tuple(range(self.layout.world_size)),)
                dp = self._lazy["dp"] = _new_subgroup(dense, self.rank, self.timeout)
                edp = self._lazy["edp"] = _new_subgroup(self.layout.edp_groups, self.rank, self.timeout)
                if self.transports is not None:
                    serve(dp, self.transports(dp))
                    serve(edp, self.transports(edp))
                elif self.local_records and dist.get_backend(dp) == "gloo":  # as the buckets', when on one host
                    _serve_local_parts(dp, None, _bucket_rings(dp, self.timeout, "data-parallel gather group"))
                    _serve_local_parts(edp, None, _bucket_rings(edp, self.timeout, "expert data-parallel gather group"))
        return self._lazy["dp"], self._lazy["edp"]

    def agreement_group(self) -> Optional[Any]:
        """A gloo group over every rank that carries only the ranks' agreement records
        (`parallel/agreement.py`), made on first use (collective: every rank asks in the same order).
        gloo also under NCCL: a record is a few integers on the CPU, checked without a device sync. With
        `local_records` and every rank on one host, the records travel through pipes instead
        (`local_channel.py`, a fraction of gloo's cost: docs/benchmarks.md#small-reduce)."""
        if "agreement" not in self._lazy:
            world = self.layout.world_size
            group = (
                None if self.dp is None else dist.new_group(list(range(world)), backend="gloo", timeout=self.timeout)
            )
            if group is not None and self.transports is not None:
                serve(group, self.transports(group))
            elif group is not None and self.local_records:
                _serve_local_parts(group, local_channel.connect(group, self.timeout, "agreement group"), None)
            self._lazy["agreement"] = group
        return self._lazy["agreement"]

    def batch_agreement_group(self) -> Optional[Any]:
        """A gloo group over the ranks that read the same micro-batches as this one (tp x cp:
        `layout.batch_groups`), carrying only their micro-batches' records (`parallel/batch_agreement.py`), made on
        first use (collective: every rank asks in the same order); None where every rank reads its own. Its records
        travel as `agreement_group`'s do."""
        if "batch" not in self._lazy:
            partition = self.layout.batch_groups()
            group = None
            if self.dp is not None and any(len(ranks) > 1 for ranks in partition):
                group = _new_subgroup(partition, self.rank, self.timeout, backend="gloo")
                if self.transports is not None:
                    serve(group, self.transports(group))
                elif self.local_records:
                    _serve_local_parts(group, local_channel.connect(group, self.timeout, "batch agreement group"), None)
            self._lazy["batch"] = group
        return self._lazy["batch"]

    def destroy(self) -> None:
        """Release the groups (tests create many; a run usually keeps one for its lifetime)."""
        seen = set()
        own = (self.dp, self.ep, self.edp, self.control, self.cp, self.tp, self.etp, self.world_control)
        for group in (*own, *self._lazy.values()):
            if group is not None and id(group) not in seen and group != dist.GroupMember.NON_GROUP_MEMBER:
                seen.add(id(group))
                release(group)
                dist.destroy_process_group(group)


def _serve_local(
    layout: RankLayout, dp: Any, control: Any, ep: Any, edp: Any, timeout: Optional[datetime.timedelta]
) -> None:
    """Collective: pipes and rings for the groups whose ranks all run on this host (local_transport.py); a group
    without either keeps gloo's default transport."""
    world = layout.world_size
    wide_ep = dist.get_world_size(ep) == world  # the same ranks: one setup for all of them
    edp_spans_world = dist.get_world_size(edp) == world  # not at etp > 1: etp x ep x edp is the world
    # pipes: the dp and control groups' short all-reduces (small_reduce.py), the ep group's count exchanges
    shared = [(dp, "data-parallel group"), (control, "control group")]
    shared += [(ep, "expert-parallel group")] if wide_ep else []
    # the buckets' reduce-scatters and all-gathers get a channel of their own: their notices must not pair with the
    # group's short all-reduces, which ranks may issue in another order around them
    buckets = [(dp, "data-parallel group's buckets")]
    buckets += [(edp, "expert data-parallel group's buckets")] if edp_spans_world else []
    channels = local_channel.connect_all(shared + buckets, timeout)
    pipes = {group: channel for (group, _), channel in zip(shared, channels)}
    rings = {
        group: local_exchange.connect(group, channel, local_exchange.BUCKETS, owns_channel=True)
        for (group, _), channel in zip(buckets, channels[len(shared) :])
    }
    if not wide_ep and dist.get_world_size(ep) > 1:
        pipes[ep] = local_channel.connect(ep, timeout, "expert-parallel group")
    if not edp_spans_world:
        rings[edp] = _bucket_rings(edp, timeout, "expert data-parallel group's buckets")
    rings[ep] = local_exchange.connect(ep, pipes.get(ep))  # the token rows, their notices on the group's pipes
    for group in (dp, control, ep, edp):
        _serve_local_parts(group, pipes.get(group), rings.get(group))


def _serve_local_parts(
    group: Any, pipes: Optional[local_channel.LocalChannel], rings: Optional[local_exchange.LocalExchange]
) -> None:
    """`group` served by its pipes and rings, where it got either."""
    if pipes is not None or rings is not None:
        serve(group, LocalTransport(group, pipes, rings))


def _bucket_rings(
    group: Optional[Any], timeout: Optional[datetime.timedelta], name: str
) -> Optional[local_exchange.LocalExchange]:
    """Collective over `group` (a rank's own, or None): shared-memory rings for its bucket-sized exchanges when its
    ranks share this host, their notices on a channel of their own (local_exchange.connect)."""
    if group is None or dist.get_world_size(group) < 2:
        return None
    channel = local_channel.connect(group, timeout, name)
    return local_exchange.connect(group, channel, local_exchange.BUCKETS, owns_channel=True)


def _new_subgroup(
    partition: Tuple[Ranks, ...], rank: int, timeout: Optional[datetime.timedelta] = None, backend: Optional[str] = None
) -> Any:
    """Every rank creates every group of the partition (new_group is collective); keep ours."""
    mine = None
    for members in partition:
        group = dist.new_group(list(members), timeout=timeout, backend=backend)
        if rank in members:
            mine = group
    return mine


class SharesProcessGroups:
    """For the objects of a model that hold process groups: `copy.deepcopy` (an EMA, a teacher) copies
    everything else and shares the groups, so the copy talks to the same ranks (a ProcessGroup cannot be
    copied or pickled)."""

    def __deepcopy__(self, memo: Dict[int, Any]):
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        for key, value in vars(self).items():
            shared = value is None or isinstance(value, (dist.ProcessGroup, ParallelGroups))
            copied.__dict__[key] = value if shared else copy.deepcopy(value, memo)
        return copied
