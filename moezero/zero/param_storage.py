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
from typing import Any, List

import torch

from moezero.parallel import ParallelGroups, comm
from moezero.zero.zero_param import ParamFamily, Range


class ParamStorage(abc.ABC):
    def __init__(self, family: ParamFamily, groups: ParallelGroups):
        self.family = family

    @abc.abstractmethod
    def values(self, bucket: int, span: Range) -> torch.Tensor:
        """Writable model-dtype values of elements [lo, hi) of `bucket` (this rank holds them)."""

    def publish(self, spans: List[Range]) -> None:
        """After `values` of each bucket's span were updated: make every param replica see them."""
        for work in self.start_publish(spans):
            work.wait()

    @abc.abstractmethod
    def start_publish(self, spans: List[Range]) -> List[Any]:
        """publish(), launched: the work handles to wait for before the params are read."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of param storage held on this rank."""

    @abc.abstractmethod
    def full_buffers(self) -> List[torch.Tensor]:
        """The tensors that hold the family's full param values on this rank now."""

    def release(self) -> None:
        """Give every param full values in storage of its own (the optimizer lets go of the model)."""
        for zp in self.family.members:
            if zp.storage_intact():
                zp.param.data = zp.param.data.clone()


class ReplicatedParams(ParamStorage):
    """Params are views of one flat buffer, moved there once at construction."""

    def __init__(self, family: ParamFamily, groups: ParallelGroups):
        super().__init__(family, groups)
        self.buffer = torch.zeros(family.layout.total_numel, dtype=family.dtype, device=family.device)
        with torch.no_grad():
            for zp in family.members:
                view = family.param_view(self.buffer, zp)
                view.copy_(zp.read(0, zp.param.numel()).view(zp.param.shape))  # a deferred param is read whole
                zp.adopt_storage(view)  # once, at construction: the param now lives in the flat buffer

    def values(self, bucket, span):
        return self.family.bucket_region(self.buffer, bucket)[span[0] : span[1]]

    def start_publish(self, spans):
        works = []
        for bucket, (lo, hi) in enumerate(spans):
            region = self.family.bucket_region(self.buffer, bucket)
            if hi - lo < region.numel():  # sharded: collect every rank's slice in place (NCCL and gloo allow it)
                works.append(comm.all_gather(region, region[lo:hi], self.family.group, async_op=True))
        return [work for work in works if work is not None]

    def nbytes(self):
        return self.buffer.numel() * self.buffer.element_size()

    def full_buffers(self):
        return [self.buffer]
