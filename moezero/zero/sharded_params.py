"""The param side of stage 3: each rank keeps only its slice of every bucket.

A family's buckets never span two gather units (`build_families` breaks buckets at unit
boundaries), so a unit is a contiguous run of whole buckets. Each unit has one full-size
tensor whose params are views; freeing the unit resizes its storage to zero and gathering
resizes it back and all-gathers every bucket's slices into it (FSDP's trick: the params keep
their identity and storage object, so tensors autograd saved in forward see the gathered
values again in backward, and no version counter moves).

A family whose gather group is one rank (routed experts at ep = world size) holds whole buckets as
its "slice": its units' full tensors are views of the shard, never freed, and gathering them
moves nothing (`local`).
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional

import torch

from moezero.parallel import ParallelGroups, comm
from moezero.zero.zero_param import ParamFamily
from moezero.zero.param_storage import ParamStorage


class ShardedParams(ParamStorage):
    def __init__(self, family: ParamFamily, groups: ParallelGroups):
        super().__init__(family, groups)
        dp, edp = groups.gather_groups()
        self.gather_group = edp if family.kind == "expert" else dp
        self.local = comm.group_size(self.gather_group) == 1
        g = family.group_size
        numels = [family.bucket_numel(b) for b in range(family.num_buckets)]
        self._shard_start = [sum(numels[:b]) // g for b in range(family.num_buckets)]
        device = family.device
        self.shard = torch.empty(sum(numels) // g, dtype=family.dtype, device=device)
        self.unit_buckets: Dict[int, List[int]] = {}
        for b in range(family.num_buckets):
            unit = family.bucket_members[b][0].unit if family.bucket_members[b] else 0
            self.unit_buckets.setdefault(unit, []).append(b)
        self._full: Dict[int, torch.Tensor] = {}
        self._nbytes: Dict[int, int] = {}
        self._fill_shard_and_adopt(device)

    def _fill_shard_and_adopt(self, device) -> None:
        family = self.family
        self.shard.zero_()
        with torch.no_grad():
            for b in range(family.num_buckets):
                shard = self.values(b, family.owned[b])
                for zp, (lo, hi), offset in family.pieces(b, family.owned[b]):  # deferred: read this slice only
                    shard[offset : offset + hi - lo].copy_(zp.read(lo, hi))
            for unit, buckets in self.unit_buckets.items():
                numel = sum(family.bucket_numel(b) for b in buckets)
                if self.local:
                    start = self._shard_start[buckets[0]]
                    full = self._full[unit] = self.shard[start : start + numel]
                else:
                    full = self._full[unit] = torch.empty(numel, dtype=family.dtype, device=device)
                for b in buckets:
                    for zp in family.bucket_members[b]:
                        zp.adopt_storage(family.view_in_bucket(self._bucket_in_unit(unit, b), zp))
                self._nbytes[unit] = 0 if self.local else full.untyped_storage().nbytes()
                if not self.local:
                    full.untyped_storage().resize_(0)  # stored as shards only from now on

    def _bucket_in_unit(self, unit: int, bucket: int) -> torch.Tensor:
        first = self.family.layout.buckets[self.unit_buckets[unit][0]].start
        b = self.family.layout.buckets[bucket]
        return self._full[unit][b.start - first : b.start - first + b.numel]

    # ---- gather / free (driven by units.UnitGatherer) ---------------------------------------------
    def gather(self, unit: int) -> List[Any]:
        """Start all-gathering the unit's buckets into its full tensor; returns the work handles."""
        if self.local:
            return []
        self._full[unit].untyped_storage().resize_(self._nbytes[unit])
        works = []
        for b in self.unit_buckets[unit]:
            works.append(
                comm.all_gather(
                    self._bucket_in_unit(unit, b),
                    self.values(b, self.family.owned[b]),
                    self.gather_group,
                    async_op=True,
                )
            )
        return [w for w in works if w is not None]

    def free(self, unit: int) -> None:
        if not self.local:
            self._full[unit].untyped_storage().resize_(0)

    def written(self, unit: int) -> List[Any]:
        """The ZeroParams of a gathered unit with an element in this rank's slice that differs from its shard:
        written in place since the gather, in whatever way (the param, an alias, `.data`). A local unit's params
        are its shard: none."""
        if self.local:
            return []
        out = []
        for b in self.unit_buckets[unit]:
            owned = self.family.owned[b]
            if not _same_bytes(self._bucket_in_unit(unit, b)[owned[0] : owned[1]], self.values(b, owned)):
                out += [zp for zp, _, _ in self.family.pieces(b, owned)]
        return out

    def members(self, unit: int) -> List[Any]:
        """The ZeroParams whose values live in the unit's full tensor."""
        return [zp for b in self.unit_buckets[unit] for zp in self.family.bucket_members[b]]

    def storage_pointer(self, unit: int) -> Optional[int]:
        """Where the unit's values are now (it changes with every gather; None: a local unit, never freed)."""
        return None if self.local else self._full[unit].untyped_storage().data_ptr()

    def full_buffers(self):
        return [full for unit, full in self._full.items() if self.is_gathered(unit)]

    def is_gathered(self, unit: int) -> bool:
        return self.local or self._full[unit].untyped_storage().nbytes() > 0

    # ---- ParamStorage -----------------------------------------------------------------------------
    def values(self, bucket, span):
        lo, hi = span
        if (lo, hi) != self.family.owned[bucket]:
            raise ValueError(f"stage 3 holds only its own slice {self.family.owned[bucket]} of bucket {bucket}")
        start = self._shard_start[bucket]
        return self.shard[start : start + hi - lo]

    def start_publish(self, spans):
        return []  # units gather the updated shards when they next run

    def nbytes(self):
        gathered = sum(self._nbytes[u] for u in self._full if self.is_gathered(u))
        return self.shard.numel() * self.shard.element_size() + gathered

    def release(self):
        """Params become plain full tensors; every unit must be gathered (the gatherer does it first)."""
        super().release()
        for unit in self._full:
            self.free(unit)


def _libc_memcmp():
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_MEMCMP = _libc_memcmp()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two contiguous tensors of one dtype and size hold the same bytes (on the CPU a memcmp: torch.equal compares
    element by element, several times slower)."""
    if _MEMCMP is not None and a.device.type == "cpu" and b.device.type == "cpu":
        return _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
    return torch.equal(a, b)
