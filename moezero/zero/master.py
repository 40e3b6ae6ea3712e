"""This rank's master weights: a copy (fp32 or wider) of its optimizer range of every bucket, and
per-param pieces of it.

The inner torch optimizer runs on the pieces (one leaf tensor per param piece, `MasterPiece`), so its
per-param semantics stay torch's: a piece whose param got no gradient on any rank gets `grad = None`
and is skipped. When a family's params are already in the master dtype, the master *is* the param
storage (no copy, no write-back). Each family has its own master dtype: the wider of its param
dtype and fp32.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from moezero.zero.families import FamilyParts, ParamFamily
from moezero.zero.zero_param import MasterPiece, Range, ZeroParam

ReducedGrads = Dict[ParamFamily, List[Optional[torch.Tensor]]]   # per family, per bucket (None: frozen)


def master_dtype_of(param_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(param_dtype, torch.float32)


class _FamilyMaster:
    """One family's masters: a flat tensor per bucket over the bucket's optimizer range."""

    def __init__(self, parts: FamilyParts):
        self.parts = parts
        family, storage, strategy = parts.family, parts.storage, parts.strategy
        dtype = master_dtype_of(family.dtype)
        self.aliased = family.dtype == dtype
        self.spans = [strategy.optimizer_range(b) for b in range(family.num_buckets)]
        self.masters = [storage.values(b, span) if self.aliased else storage.values(b, span).detach().to(dtype)
                        for b, span in enumerate(self.spans)]

    def pieces(self) -> List[MasterPiece]:
        family = self.parts.family
        out = []
        for b, span in enumerate(self.spans):
            for zp, param_range, offset in family.pieces(b, span):
                n = param_range[1] - param_range[0]
                out.append(MasterPiece(zp, param_range, offset, self.masters[b][offset:offset + n],
                                       _owned_part(zp, param_range, family.owned[b])))
        return out


def _owned_part(zp: ZeroParam, param_range: Range, owned: Range) -> slice:
    """The part of a piece inside the bucket range this rank owns, in the piece's own coordinates."""
    lo, hi = zp.bucket_range(param_range)
    a, b = max(lo, owned[0]), min(hi, owned[1])
    return slice(a - lo, b - lo) if a < b else slice(0, 0)


class MasterShards:
    def __init__(self, parts: Sequence[FamilyParts]):
        self.families = [_FamilyMaster(p) for p in parts]
        self.pieces: List[MasterPiece] = [piece for fm in self.families for piece in fm.pieces()]

    def assign_grads(self, reduced: ReducedGrads) -> None:
        """Point each piece's .grad at its slice of the reduced bucket gradient (None: skip the param)."""
        for piece in self.pieces:
            zp = piece.param
            piece.master.grad = piece.of(reduced[zp.family][zp.bucket]) if zp.got_grad_anywhere else None

    def clear_grads(self) -> None:
        for piece in self.pieces:
            piece.master.grad = None

    def publish(self, trainable_only: bool = False) -> None:
        """Write the updated masters into the param storage (cast) and let every replica see them
        (`trainable_only`: after a step, which never changes a frozen family)."""
        for fm in self.families:
            family, storage = fm.parts.family, fm.parts.storage
            if trainable_only and not family.trainable:
                continue
            if not fm.aliased:
                with torch.no_grad():
                    for b, span in enumerate(fm.spans):
                        storage.values(b, span).copy_(fm.masters[b])
            storage.publish(fm.spans)

    def unaliased(self) -> List[torch.Tensor]:
        """The masters that are copies (their bytes are the optimizer's, not the params')."""
        return [m for fm in self.families if not fm.aliased for m in fm.masters]
