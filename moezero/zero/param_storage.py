"""The param side of a family: where its params' values live and how updated shards reach them.

  ReplicatedParams (stages 0-2): the family's params are views of one full flat buffer in the
      model dtype; after a step each rank's updated slice is all-gathered in place.
  ShardedParams (stage 3, `sharded_params.py`): each rank keeps only its slice of every bucket;
      full params exist only while their unit is gathered.

Both hand the master weights the model-dtype values of a bucket range (`values`), which the
master aliases when the dtypes match, and publish updated values (`publish`).
"""
from __future__ import annotations

import abc
from typing import List

import torch

from moezero.parallel import comm
from moezero.parallel.deferred_values import allocate, read_values, values_arrived
from moezero.zero.families import ParamFamily, Range
from moezero.zero.torch_internals import storage_key


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage; survives a stage-3 free/regather (a storage resize)."""
    return storage_key(tensor)


class ParamStorage(abc.ABC):
    def __init__(self, family: ParamFamily):
        self.family = family

    @abc.abstractmethod
    def values(self, bucket: int, span: Range) -> torch.Tensor:
        """Writable model-dtype values of elements [lo, hi) of `bucket` (this rank holds them)."""

    @abc.abstractmethod
    def publish(self, spans: List[Range]) -> None:
        """After `values` of each bucket's span were updated: make every param replica see them."""

    @abc.abstractmethod
    def storage_intact(self, index: int) -> bool:
        """False when param `index` no longer lives where this storage put it (a .data swap, a cast)."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of param storage held on this rank."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give every param full values in storage of its own (the optimizer lets go of the model)."""


def storage_device(params) -> torch.device:
    """Where a family's storage lives: its params' device (the CPU for params still deferred on meta)."""
    return next((p.device for p in params if p.device.type != "meta"), torch.device("cpu"))


class ReplicatedParams(ParamStorage):
    """Params are views of one flat buffer, moved there once at construction."""

    def __init__(self, family: ParamFamily):
        super().__init__(family)
        device = storage_device(family.params)
        self.buffer = torch.zeros(family.layout.total_numel, dtype=family.dtype, device=device)
        with torch.no_grad():
            for index, p in enumerate(family.params):
                view = family.param_view(self.buffer, index)
                view.copy_(read_values(p, 0, p.numel()).view(p.shape))   # a deferred param is read whole
                if p.device.type == "meta":   # deferred: it never held its values
                    allocate(p, device, empty=True)
                p.data = view  # once, at construction: the param now lives in the flat buffer
                values_arrived(p)
        self._storage = storage_id(self.buffer)

    def values(self, bucket, span):
        return self.family.bucket_region(self.buffer, bucket)[span[0]:span[1]]

    def publish(self, spans):
        works = []
        for bucket, (lo, hi) in enumerate(spans):
            region = self.family.bucket_region(self.buffer, bucket)
            if hi - lo < region.numel():  # sharded: collect every rank's slice in place (NCCL and gloo allow it)
                works.append(comm.all_gather(region, region[lo:hi], self.family.group, async_op=True))
        for work in works:
            if work is not None:
                work.wait()

    def storage_intact(self, index):
        return storage_id(self.family.params[index]) == self._storage

    def nbytes(self):
        return self.buffer.numel() * self.buffer.element_size()

    def release(self):
        for index, p in enumerate(self.family.params):
            if self.storage_intact(index):
                p.data = p.data.clone()
