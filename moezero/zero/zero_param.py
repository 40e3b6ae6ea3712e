"""ZeroParam: everything the optimizer knows about one param, in one record (FSDP2's FSDPParam is the model);
ParamFamily: the records of the params reduced over one group in one dtype (`param_families.py` groups them).

    who         name, the nn.Parameter, its family, its stage-3 gather unit
    where       its slot in the family's flat layout (bucket, offset, numel), its position among the
                bucket's params, its placement in its global tensor (routed experts stacked along dim 0)
    storage     which storage the optimizer put it in (`adopt_storage`), so a replaced one is noticed
    this rank   the piece of it whose master weights this rank holds: a MasterPiece (master.py) points here
    this step   fired (its gradient arrived in this backward), got_grad (in some backward of the step on this
                rank), got_grad_anywhere (on some rank; set at step()), exposed (.grad is one of our views)

Coordinates. An element of a param has four addresses, and each conversion is written once, here:
    param       its index in the param's own flat elements
    bucket      param + slot.offset                            (`ZeroParam.bucket_range`, `.param_range_in`)
    optimizer   bucket - start of the bucket's optimizer range (`optimizer_slice`; `MasterPiece.offset` is one)
    global      param + the param's offset in its global tensor (`ZeroParam.global_range`; a tensor-parallel
                shard maps through its TensorShard, `ZeroParam.global_ranges`)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from moezero.parallel import comm, expert_shard_of
from moezero.parallel.tensor_marker import TensorShard, tensor_shard_of
from moezero.deferred_values import allocate, read_values, values_arrived
from moezero.zero.partition import FlatLayout, ParamSlot, shard_overlap
from moezero.zero.sharded_gradient import ShardedGradient
from moezero.torch_internals import storage_key

Range = Tuple[int, int]


def global_placement(param: torch.Tensor) -> Tuple[Tuple[int, ...], int]:
    """(global shape, flat offset of this rank's tensor inside it); experts stack along dim 0; a tensor-parallel
    shard's offset is where its first element sits (its elements map through `ZeroParam.global_ranges`)."""
    tensor_shard = tensor_shard_of(param)
    if tensor_shard is not None:
        first = _tensor_shard_ranges(param, tensor_shard, 0, 1)[0][0] if param.numel() else 0
        shard = expert_shard_of(param)
        if shard is None:
            return tensor_shard.global_shape, first
        return (shard.num_global_experts,) + tensor_shard.global_shape[1:], first
    shard = expert_shard_of(param)
    if shard is None:
        return tuple(param.shape), 0
    per_expert = param.numel() // shard.num_local_experts
    return (shard.num_global_experts,) + tuple(param.shape[1:]), shard.first_global_expert * per_expert


def param_global_ranges(param: torch.Tensor) -> List[Range]:
    """The global flat ranges holding all of this rank's tensor, in its element order."""
    tensor_shard = tensor_shard_of(param)
    if tensor_shard is not None:
        return _tensor_shard_ranges(param, tensor_shard, 0, param.numel())
    _, offset = global_placement(param)
    return [(offset, offset + param.numel())]


def _tensor_shard_ranges(param: torch.Tensor, tensor_shard: TensorShard, lo: int, hi: int) -> List[Range]:
    """The global flat ranges of the param's elements [lo, hi). An expert stack split over expert tensor parallelism
    has a TensorShard over the rank's own experts, which its ExpertShard places among the global ones: every range
    moves by where the rank's first expert starts."""
    ranges = tensor_shard.global_flat_ranges(lo, hi)
    shard = expert_shard_of(param)
    if shard is None:
        return ranges
    shift = shard.first_global_expert * math.prod(tensor_shard.global_shape[1:])
    return [(start + shift, stop + shift) for start, stop in ranges]


def optimizer_slice(bucket_range: Range, optimizer_range: Range) -> slice:
    """A bucket range as a slice of a tensor over the bucket's optimizer range (masters, reduced gradients)."""
    return slice(bucket_range[0] - optimizer_range[0], bucket_range[1] - optimizer_range[0])


@dataclass
class MasterPiece:
    """The part of one param whose master weights this rank holds: the leaf the inner optimizer steps."""

    param: "ZeroParam"
    param_range: Range  # param coordinates
    offset: int  # optimizer coordinates: where the piece starts in its bucket's master
    master: torch.Tensor
    owned: slice  # the part of the piece this rank owns (all of it, except at stage 0)

    @property
    def numel(self) -> int:
        return self.param_range[1] - self.param_range[0]

    def of(self, bucket_flat: torch.Tensor) -> torch.Tensor:
        """The piece's slice of a tensor over the bucket's optimizer range (a reduced gradient)."""
        return bucket_flat[self.offset : self.offset + self.numel]

    def global_range(self, part: slice) -> Range:
        start = self.param_range[0] + part.start
        return self.param.global_range((start, start + part.stop - part.start))

    def global_ranges(self, part: slice) -> List[Range]:
        start = self.param_range[0] + part.start
        return self.param.global_ranges((start, start + part.stop - part.start))


@dataclass(eq=False)
class ZeroParam:
    name: str
    param: nn.Parameter
    slot: ParamSlot
    position: int  # among its bucket's params
    unit: int = 0  # stage-3 gather unit (0: the root; stages 0-2: all 0)
    family: Optional["ParamFamily"] = field(default=None, repr=False)
    fired: bool = False
    got_grad: bool = False
    got_grad_anywhere: bool = False
    exposed: bool = False
    _placeholder: Optional[ShardedGradient] = field(default=None, repr=False)
    _home: Optional[int] = field(default=None, repr=False)  # storage_key of where the optimizer put it

    def __post_init__(self):
        self.global_shape, self.global_offset = global_placement(self.param)

    @property
    def bucket(self) -> int:
        return self.slot.bucket

    # ---- coordinates -----------------------------------------------------------------------------
    def bucket_range(self, param_range: Range) -> Range:
        return self.slot.offset + param_range[0], self.slot.offset + param_range[1]

    def param_range_in(self, span: Range) -> Optional[Range]:
        """The part of this param inside a bucket range, in param coordinates (None: no overlap)."""
        return shard_overlap(self.slot, span)

    def global_ranges(self, param_range: Range) -> List[Range]:
        """The global flat ranges holding a range of the param's elements: one, except for a tensor-parallel
        shard whose range crosses several of its blocks (fused parts) or rows (a dim-1 split)."""
        tensor_shard = tensor_shard_of(self.param)
        if tensor_shard is None:
            return [self.global_range(param_range)]
        return _tensor_shard_ranges(self.param, tensor_shard, *param_range)

    def global_range(self, param_range: Range) -> Range:
        """The one global flat range holding a range of the param's elements (optimizer checkpoint pieces)."""
        tensor_shard = tensor_shard_of(self.param)
        if tensor_shard is None:
            return self.global_offset + param_range[0], self.global_offset + param_range[1]
        ranges = _tensor_shard_ranges(self.param, tensor_shard, *param_range)
        if len(ranges) != 1:
            raise ValueError(
                f"'{self.name}': its elements {param_range} lie in {len(ranges)} global ranges of its tensor-parallel "
                "global tensor; optimizer state pieces of such shards (fused parts, dim-1 splits) are not supported yet"
            )
        return ranges[0]

    def sharded_gradient(self) -> ShardedGradient:
        """What its .grad shows once its gradient lives only in the optimizer's shards (made once)."""
        if self._placeholder is None:
            self._placeholder = ShardedGradient(self.param, self.name)
        self._placeholder.zeroed = False
        return self._placeholder

    def shows_sharded_gradient(self) -> bool:
        return self._placeholder is not None and self.param.grad is self._placeholder

    def cleared_after_backward(self) -> bool:
        """The user cleared what .grad showed after the last backward: our view set to None (zeroing it zeroed
        the buffer), or the placeholder set to None or zeroed."""
        return self.param.grad is None if self.exposed else self.placeholder_cleared()

    def placeholder_cleared(self) -> bool:
        """The user cleared the placeholder .grad showed (`p.grad = None`, `zero_grad()` either way)."""
        grad = self.param.grad
        return self._placeholder is not None and (grad is None or (grad is self._placeholder and grad.zeroed))

    # ---- storage ---------------------------------------------------------------------------------
    def read(self, lo: int, hi: int) -> torch.Tensor:
        """Its flat elements [lo, hi): from its checkpoint reader while deferred, else from its data."""
        return read_values(self.param, lo, hi)

    def adopt_storage(self, home: torch.Tensor) -> None:
        """From now on the param's values live in `home` (a view shaped like it, in the optimizer's buffer)."""
        p = self.param
        if p.device.type == "meta":  # deferred: it never held its values
            allocate(p, home.device, empty=True)
        p.data = home
        values_arrived(p)
        self._home = storage_key(home)

    def storage_intact(self) -> bool:
        """False when the param no longer lives where the optimizer put it (a .data swap, a cast)."""
        return storage_key(self.param) == self._home


@dataclass(eq=False)
class ParamFamily:
    """Params of one (reduce group, dtype); see param_families.py's docstring."""

    kind: str  # "dense", "expert", or replicated over tp: "tp_copies", "tp_partial" (param_families.family_kind)
    dtype: torch.dtype
    trainable: bool  # False: frozen when adopted; no gradient hooks, never reduced
    group: Optional[Any]  # the reduce group (dp or edp)
    members: List[ZeroParam]  # in layout order
    layout: FlatLayout

    def __post_init__(self):
        self.group_rank = comm.group_rank(self.group)
        self.group_size = comm.group_size(self.group)
        self.owned: List[Range] = [b.shard_range(self.group_rank, self.group_size) for b in self.layout.buckets]
        self.bucket_members: List[List[ZeroParam]] = [[self.members[i] for i in b.params] for b in self.layout.buckets]
        for zp in self.members:
            zp.family = self

    @property
    def replicated_over_tp(self) -> bool:
        """Its params are whole on every tensor-parallel rank, with the same reduced gradient on each (for
        "tp_partial" once summed over tp): their elements count once in sums over the model."""
        return self.kind in ("tp_copies", "tp_partial")

    @property
    def num_buckets(self) -> int:
        return len(self.layout.buckets)

    @property
    def device(self) -> torch.device:
        """Where the family's storage lives: its params' device (the CPU for params still deferred on meta)."""
        return next((zp.param.device for zp in self.members if zp.param.device.type != "meta"), torch.device("cpu"))

    def bucket_numel(self, bucket: int) -> int:
        return self.layout.buckets[bucket].numel

    def bucket_region(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        """The bucket's slice of a family-sized flat tensor."""
        b = self.layout.buckets[bucket]
        return flat[b.start : b.start + b.numel]

    def view_in_bucket(self, bucket_tensor: torch.Tensor, zp: ZeroParam) -> torch.Tensor:
        """The param's slice of a bucket-sized flat tensor, shaped like the param."""
        lo, hi = zp.bucket_range((0, zp.slot.numel))
        return bucket_tensor[lo:hi].view(zp.param.shape)

    def param_view(self, flat: torch.Tensor, zp: ZeroParam) -> torch.Tensor:
        """The param's slice of a family-sized flat tensor, shaped like the param."""
        return self.view_in_bucket(self.bucket_region(flat, zp.bucket), zp)

    def pieces(self, bucket: int, span: Range) -> List[Tuple[ZeroParam, Range, int]]:
        """(param, its part inside the bucket range `span` in param coordinates, where that part starts in
        `span`)."""
        out = []
        for zp in self.bucket_members[bucket]:
            part = zp.param_range_in(span)
            if part is not None:
                out.append((zp, part, optimizer_slice(zp.bucket_range(part), span).start))
        return out
