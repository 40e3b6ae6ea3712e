"""This rank's master weights: a copy (fp32 or wider) of its optimizer range of every bucket, and
per-param pieces of it.

The inner torch optimizer runs on the pieces (one leaf tensor per param piece, `MasterPiece`), so its
per-param semantics stay torch's: a piece whose param got no gradient on any rank gets `grad = None`
and is skipped. When a family's params are already in the master dtype, the master *is* the param
storage (no copy, no write-back). Each family has its own master dtype: the wider of its param
dtype and fp32. An inner optimizer that keeps master weights of its own (`holds_master_weights`, as
PrecisionAwareAdam) steps the param storage itself and gets its gradients as `decoupled_grad`, whose dtype
(the main-grads dtype) may differ from the param's.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from moezero.zero.stages import FamilyParts
from moezero.torch_internals import no_subclass_dispatch
from moezero.zero.zero_param import MasterPiece, ParamFamily, Range, ZeroParam

ReducedGrads = Dict[ParamFamily, List[Optional[torch.Tensor]]]  # per family, per bucket (None: frozen)


def master_dtype_of(param_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(param_dtype, torch.float32)


class _FamilyMaster:
    """One family's masters: a flat tensor per bucket over the bucket's optimizer range."""

    def __init__(self, parts: FamilyParts, in_optimizer: bool):
        self.parts = parts
        family, storage, strategy = parts.family, parts.storage, parts.strategy
        dtype = master_dtype_of(family.dtype)
        self.aliased = family.dtype == dtype or in_optimizer
        self.grad_attribute = "decoupled_grad" if in_optimizer else "grad"
        self.spans = [strategy.optimizer_range(b) for b in range(family.num_buckets)]
        self.masters = [
            storage.values(b, span) if self.aliased else storage.values(b, span).detach().to(dtype)
            for b, span in enumerate(self.spans)
        ]

    def pieces(self) -> List[MasterPiece]:
        family = self.parts.family
        out = []
        for b, span in enumerate(self.spans):
            for zp, param_range, offset in family.pieces(b, span):
                n = param_range[1] - param_range[0]
                out.append(
                    MasterPiece(
                        zp,
                        param_range,
                        offset,
                        self.masters[b][offset : offset + n],
                        _owned_part(zp, param_range, family.owned[b]),
                    )
                )
        return out


def _owned_part(zp: ZeroParam, param_range: Range, owned: Range) -> slice:
    """The part of a piece inside the bucket range this rank owns, in the piece's own coordinates."""
    lo, hi = zp.bucket_range(param_range)
    a, b = max(lo, owned[0]), min(hi, owned[1])
    return slice(a - lo, b - lo) if a < b else slice(0, 0)


class MasterShards:
    def __init__(self, parts: Sequence[FamilyParts], in_optimizer: bool = False):
        self.families = [_FamilyMaster(p, in_optimizer) for p in parts]
        self._pieces_of = {id(fm): fm.pieces() for fm in self.families}
        self.pieces: List[MasterPiece] = [piece for fm in self.families for piece in self._pieces_of[id(fm)]]

    def update_order(self) -> List["_FamilyMaster"]:
        """The trainable families, those whose publishing gathers over other ranks first (see ZeroEngine.update)."""
        trainable = [fm for fm in self.families if fm.parts.family.trainable]
        return sorted(trainable, key=lambda fm: fm.parts.family.group_size == 1)

    def assign_grads(self, reduced: ReducedGrads, family: Optional["_FamilyMaster"] = None) -> None:
        """Point each piece's .grad (of `family`, default all) at its slice of the reduced bucket gradient (None:
        skip the param)."""
        for fm in self._families(family):
            for piece in self._pieces_of[id(fm)]:
                zp = piece.param
                grad = piece.of(reduced[zp.family][zp.bucket]) if zp.got_grad_anywhere else None
                setattr(piece.master, fm.grad_attribute, grad)

    def clear_grads(self, family: Optional["_FamilyMaster"] = None) -> None:
        for fm in self._families(family):
            for piece in self._pieces_of[id(fm)]:
                setattr(piece.master, fm.grad_attribute, None)

    def _families(self, family: Optional["_FamilyMaster"]) -> List["_FamilyMaster"]:
        return self.families if family is None else [family]

    def publish(self, trainable_only: bool = False) -> None:
        """Write the updated masters into the param storage (cast) and let every replica see them
        (`trainable_only`: after a step, which never changes a frozen family)."""
        works = [
            work
            for fm in self.families
            if fm.parts.family.trainable or not trainable_only
            for work in self.start_publish(fm)
        ]
        for work in works:
            work.wait()

    def start_publish(self, family: "_FamilyMaster") -> List:
        """One family's publish, launched: write its masters into the param storage, start the all-gather; the work
        handles to wait for."""
        storage = family.parts.storage
        if not family.aliased:
            with torch.no_grad():
                for b, span in enumerate(family.spans):
                    storage.values(b, span).copy_(family.masters[b])
        return storage.start_publish(family.spans)

    def take_written_values(self, params: Sequence[ZeroParam]) -> None:
        """The params' current values (written by the user in place) become this rank's: its slice of the param
        storage (stage 3's shard) and the masters, where an element that changed takes the new value and one that
        did not keeps its wider master. Not collective: each rank takes its own slice (every rank wrote the same)."""
        wanted = {id(zp) for zp in params}
        with torch.no_grad(), no_subclass_dispatch():
            for fm in self.families:
                storage = fm.parts.storage
                for piece in self._pieces_of[id(fm)]:
                    zp = piece.param
                    if id(zp) not in wanted or not zp.storage_intact():
                        continue
                    new = zp.param.reshape(-1)[piece.param_range[0] : piece.param_range[1]]
                    held = piece.of(storage.values(zp.bucket, fm.spans[zp.bucket]))
                    if not fm.aliased:
                        changed = new != piece.master.to(new.dtype)
                        piece.master.copy_(torch.where(changed, new.to(piece.master.dtype), piece.master))
                    if held.data_ptr() != new.data_ptr():
                        held.copy_(new)

    def unaliased(self) -> List[torch.Tensor]:
        """The masters that are copies (their bytes are the optimizer's, not the params')."""
        return [m for fm in self.families if not fm.aliased for m in fm.masters]
