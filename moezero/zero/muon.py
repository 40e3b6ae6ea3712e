"""Megatron's Muon under ZeRO: `ZeroOptimizer(model, Muon, groups, param_groups=muon_param_groups(model, wd), ...)`.

Megatron-core's Muon (its TensorParallelMuon over NVIDIA's emerging_optimizers OrthogonalizedOptimizer) for the
2-D weights, AdamW for the rest (embeddings, the output layer, biases, norms: megatron-core's
get_megatron_muon_optimizer). Per Muon weight W with gradient G, momentum m, learning rate lr, weight decay wd:

    W -= lr * wd * W                                  decoupled weight decay, first
    M  = lerp(M, G, 1 - m)                            the momentum buffer (element-wise)
    U  = lerp(G, M, m) with nesterov, else M
    W -= lr * extra_scale * scale(out, in) * NS(U)    Newton-Schulz on each whole matrix

Under ZeRO each rank holds a flat shard of the masters, so everything but NS runs element-wise on the shard. The
update's shards are then summed over the family's reduce group into whole params (dense over dp, experts over edp;
every element is held by exactly one rank, the others add exact zeros), each rank orthogonalises the matrices it
holds a piece of (a stacked expert tensor one expert at a time, as Megatron's per-expert weights) and applies its
piece. Stage 0 holds whole buckets: nothing to sum. Stage 3 steps the same shards.

At tensor parallelism a whole update is the rank's tp shard of the weight; `tp_mode` is megatron-core's
muon_tp_mode: "blockwise" orthogonalises the shard (scaled by its shape), "duplicated" (and "distributed", the same
numbers) all-gathers the shards over the tp group (experts' over etp) and orthogonalises the whole weight (scaled by
its global shape), each rank keeping its part.
"""

from __future__ import annotations

import contextlib
from itertools import chain, cycle, islice, repeat
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moezero.parallel import comm, is_expert_parallel
from moezero.parallel.tensor_marker import TensorShard, tensor_shard_of
from moezero.parallel.tp_linear import ColumnParallelLinear
from moezero.parallel.vocab_parallel import VocabParallelEmbedding
from moezero.zero.param_groups import weight_decay_groups

# emerging_optimizers' muon_utils (the release megatron-core 0.16.1 runs with)
COEFFICIENT_SETS: Dict[str, List[Tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
# megatron-core's muon_tp_mode: blockwise orthogonalises each tp rank's own shard; duplicated the whole matrix,
# gathered over tp; distributed the same with distributed matmuls (run here as duplicated)
TP_MODES = ("blockwise", "duplicated", "distributed")
MATMUL_PRECISIONS = ("medium", "high")  # torch's set_float32_matmul_precision takes no "low"
NS_EPS = 1e-7


def coefficients(kind: str, steps: int) -> List[Tuple[float, float, float]]:
    """The (a, b, c) of each NS step: the set cycled, polar_express's last one repeated."""
    sets = COEFFICIENT_SETS[kind]
    base = chain(sets, repeat(sets[-1])) if kind == "polar_express" else cycle(sets)
    return list(islice(base, steps))


def newton_schulz(x: torch.Tensor, coeffs: Sequence[Tuple[float, float, float]], bf16: bool) -> torch.Tensor:
    """emerging_optimizers' newton_schulz on one matrix, in x's dtype (`bf16`: fp32 precision "medium", whose
    iterations run in bf16)."""
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = F.normalize(x, p=2, dim=(-2, -1), eps=NS_EPS)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in coeffs:
        A = X @ X.mT
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(x.dtype)
    return X.mT if transpose else X


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """torch's float32 matmul precision inside (on GPUs "high" allows TF32), restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def scale_factor(size_out: int, size_in: int, mode: str) -> float:
    """emerging_optimizers' get_muon_scale_factor."""
    if mode == "shape_scaling":
        return max(1, size_out / size_in) ** 0.5
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    return (size_out / size_in) ** 0.5


class Muon(torch.optim.AdamW):
    """Megatron's Muon for the groups marked `"muon": True`, torch's AdamW for the others (the lr, betas, eps and
    weight_decay of a group are its optimizer's). Muon keywords: momentum (Megatron's --muon-momentum), nesterov,
    scale_mode, extra_scale_factor, num_ns_steps, coefficient_type, fp32_matmul_prec, tp_mode. A Muon group may carry
    "muon_split_rows": its weights' rows are orthogonalised in blocks of these sizes (Megatron's split of the
    fused QKV weight into queries, keys and values).

    Under ZeroOptimizer its params are master pieces; ZeroOptimizer passes `whole_params` (`WholeParams`) so the
    step can assemble each update's whole matrix. Alone (a single process, whole params) it needs none."""

    needs_whole_params = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.9,
        nesterov: bool = False,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        num_ns_steps: int = 5,
        coefficient_type: str = "quintic",
        fp32_matmul_prec: str = "medium",
        tp_mode: str = "blockwise",
        whole_params: Optional["WholeParams"] = None,
        **adamw_kwargs,
    ):
        check_muon_settings(momentum, scale_mode, num_ns_steps, coefficient_type, fp32_matmul_prec)
        if tp_mode not in TP_MODES:
            raise ValueError(f"--muon-tp-mode {tp_mode!r}: choose one of {', '.join(TP_MODES)}")
        super().__init__(params, lr=lr, **adamw_kwargs)
        if not any(g.get("muon") for g in self.param_groups):
            raise ValueError('Muon got no group marked "muon": True: pass param_groups=muon_param_groups(model, wd)')
        self.momentum, self.nesterov = momentum, nesterov
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        self.coeffs = coefficients(coefficient_type, num_ns_steps)
        self.fp32_matmul_prec = fp32_matmul_prec
        self.whole_matrices = tp_mode != "blockwise"
        self.whole_params = whole_params

    @torch.no_grad()
    def step(self, closure=None):
        groups = self.param_groups
        try:
            self.param_groups = [g for g in groups if not g.get("muon")]
            super().step(closure)
        finally:
            self.param_groups = groups
        updates = {}
        for group in groups:
            if group.get("muon"):
                updates.update(self._momentum_updates(group))
        whole = (
            self.whole_params.assemble(updates, groups, gather_tp=self.whole_matrices)
            if self.whole_params
            else _unsharded(updates)
        )
        with matmul_precision(self.fp32_matmul_prec):  # emerging_optimizers' context around the orthogonalisation
            for group in groups:
                if group.get("muon"):
                    for p in group["params"]:
                        if p in updates:
                            p.add_(self._orthogonalised(p, whole[p], group), alpha=-group["lr"])

    def _momentum_updates(self, group: Dict) -> Dict[torch.Tensor, torch.Tensor]:
        """Weight decay and momentum, element-wise on each piece: {piece: its update before NS}."""
        out = {}
        lr, wd = group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            if wd != 0.0:
                p.add_(p, alpha=-wd * lr)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - self.momentum)
            out[p] = p.grad.lerp(buf, self.momentum) if self.nesterov else buf.clone()
        return out

    def _orthogonalised(self, p: torch.Tensor, whole: "WholeUpdate", group: Dict) -> torch.Tensor:
        """The scaled NS of the whole matrices (or of the tp shards, blockwise), this piece's elements of it."""
        tp = whole.tp_peers
        if whole.expert_stack:  # (experts, in, out): Megatron's per-expert (out, in) weights, transposed
            peers = [None] * len(whole.value) if tp is None else list(zip(*[v.mT.unbind(0) for v in tp.values]))
            out = torch.stack([self._scaled_ns(m.mT, group, tp, ps).mT for m, ps in zip(whole.value, peers)])
        else:
            out = self._scaled_ns(whole.value, group, tp, None if tp is None else tp.values)
        return out.reshape(-1)[whole.piece_range[0] : whole.piece_range[1]].view_as(p)

    def _scaled_ns(
        self, matrix: torch.Tensor, group: Dict, tp: Optional["TpPeers"], peers: Optional[Sequence[torch.Tensor]]
    ) -> torch.Tensor:
        """Megatron's scaled_orthogonalize_fn on an (out, in) matrix, in row blocks where the group splits it (the
        rank's shard of each block: QKV split per shard as Megatron's). With `tp`, `peers` are the tp ranks' shards
        of the matrix: each block is orthogonalised and scaled as the whole block, joined along the partition dim
        (NS is equivariant under permutations of rows and columns, so the order of a fused weight's parts is
        immaterial), and this rank's part is kept."""
        if matrix.ndim != 2:
            raise ValueError(f"Muon orthogonalises 2-D weights, got a {matrix.ndim}-D one")
        splits = group.get("muon_split_rows")
        blocks = torch.split(matrix, list(splits)) if splits else [matrix]
        bf16 = self.fp32_matmul_prec == "medium" and matrix.dtype == torch.float32
        out = []
        for i, block in enumerate(blocks):
            if tp is None:
                out.append(newton_schulz(block, self.coeffs, bf16) * scale_factor(*block.shape, self.scale_mode))
                continue
            dim = tp.partition_dim
            joined = torch.cat([torch.split(m, list(splits))[i] if splits else m for m in peers], dim)
            orth = newton_schulz(joined, self.coeffs, bf16) * scale_factor(*joined.shape, self.scale_mode)
            width = block.size(dim)
            out.append(orth.narrow(dim, tp.rank * width, width))
        return torch.cat(out) * self.extra_scale_factor


def check_muon_settings(momentum, scale_mode, num_ns_steps, coefficient_type, fp32_matmul_prec) -> None:
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"--muon-momentum {momentum}: it must lie in [0, 1)")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"--muon-scale-mode {scale_mode!r}: choose one of {', '.join(SCALE_MODES)}")
    if num_ns_steps < 1:
        raise ValueError(f"--muon-num-ns-steps {num_ns_steps}: at least 1")
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(f"--muon-coefficient-type {coefficient_type!r}: choose one of {', '.join(COEFFICIENT_SETS)}")
    if fp32_matmul_prec not in MATMUL_PRECISIONS:
        raise ValueError(
            f"--muon-fp32-matmul-prec {fp32_matmul_prec!r}: choose medium or high (torch has no 'low' precision)"
        )


class TpPeers:
    """A tensor-parallel param's whole updates on every rank of its tp (or etp) group, in group order: `rank` is
    this rank's place, `partition_dim` the dim of the (out, in) matrix the shards split (0: column-parallel, 1:
    row-parallel)."""

    def __init__(self, values: List[torch.Tensor], rank: int, shard: TensorShard, expert_stack: bool):
        self.values, self.rank = values, rank
        # an expert stack is (experts, in, out): its shard's dim 1 or 2 is the (out, in) matrix's 1 or 0
        self.partition_dim = 2 - shard.dim if expert_stack else shard.dim


class WholeUpdate:
    """One piece's param, whole: its update (param-shaped), where the piece lies in it, and at tp (modes other than
    blockwise) the tp ranks' updates of the param."""

    def __init__(
        self,
        value: torch.Tensor,
        piece_range: Tuple[int, int],
        expert_stack: bool,
        tp_peers: Optional[TpPeers] = None,
    ):
        self.value, self.piece_range, self.expert_stack = value, piece_range, expert_stack
        self.tp_peers = tp_peers


class WholeParams:
    """Assembles each Muon param's whole update from the ranks' pieces (ZeroOptimizer builds it).

    `families`: the trainable ParamFamilies (one order on every rank); `pieces`: this rank's MasterPieces;
    `group_index`: {id(param): its param group's index}; `sharded`: whether the pieces are shards (stages 1-3)
    rather than whole buckets (stage 0); `tp`, `etp`: the tensor-parallel groups of the dense and expert params
    (None at size 1)."""

    def __init__(
        self,
        families: Sequence,
        pieces: Iterable,
        group_index: Dict[int, int],
        sharded: bool,
        tp: Optional[object] = None,
        etp: Optional[object] = None,
    ):
        self.families = list(families)
        self.piece_of = {piece.master: piece for piece in pieces}
        self.group_index, self.sharded = group_index, sharded
        self.tp, self.etp = tp, etp

    def assemble(self, updates: Dict[torch.Tensor, torch.Tensor], groups: List[Dict], gather_tp: bool = False) -> Dict:
        """{piece: WholeUpdate} for every piece in `updates`. Collective over each family's group when sharded:
        every rank sums the same params (the family's Muon params that got a gradient on some rank). With
        `gather_tp`, collective over the family's tp group too where it holds tp shards: every rank of it gathers
        the others' updates of those params (the tp ranks of one dp rank hold the same families' members)."""
        by_param: Dict[int, List[torch.Tensor]] = {}
        for p in updates:
            by_param.setdefault(id(self.piece_of[p].param), []).append(p)
        out = {}
        for family in self.families:
            members = [
                zp
                for zp in family.members
                if zp.got_grad_anywhere and groups[self.group_index[id(zp.param)]].get("muon")
            ]
            if not members:
                continue
            flat = torch.zeros(
                sum(zp.param.numel() for zp in members), dtype=_master_dtype(family), device=family.device
            )
            starts, at = {}, 0
            for zp in members:
                starts[id(zp)] = at
                for p in by_param.get(id(zp), []):
                    lo, hi = self.piece_of[p].param_range
                    flat[at + lo : at + hi] = updates[p].reshape(-1)
                at += zp.param.numel()
            if self.sharded:
                comm.all_reduce(flat, family.group)  # nothing where the group is this rank alone
            tp_group = self.etp if family.kind == "expert" else self.tp
            gathered = _tp_gathered(flat, members, tp_group) if gather_tp else None
            for zp in members:
                at, numel, shape = starts[id(zp)], zp.param.numel(), zp.param.shape
                stack, shard = is_expert_parallel(zp.param), tensor_shard_of(zp.param)
                peers = None
                if gathered is not None and shard is not None:
                    values = [g[at : at + numel].view(shape) for g in gathered]
                    peers = TpPeers(values, comm.group_rank(tp_group), shard, stack)
                value = flat[at : at + numel].view(shape)
                for p in by_param.get(id(zp), []):
                    out[p] = WholeUpdate(value, self.piece_of[p].param_range, stack, peers)
        return out


def _tp_gathered(flat: torch.Tensor, members: Sequence, tp_group) -> Optional[List[torch.Tensor]]:
    """Every tp rank's `flat` (the same members' updates, in group order), None where no member is a tp shard."""
    size = comm.group_size(tp_group)
    if size == 1 or not any(tensor_shard_of(zp.param) is not None for zp in members):
        return None
    out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    comm.all_gather(out, flat, tp_group)
    return list(out.view(size, -1).unbind(0))


def _unsharded(updates: Dict[torch.Tensor, torch.Tensor]) -> Dict[torch.Tensor, WholeUpdate]:
    """A single process's whole params: each update is its own whole."""
    return {p: WholeUpdate(u, (0, p.numel()), is_expert_parallel(p)) for p, u in updates.items()}


def _master_dtype(family) -> torch.dtype:
    return torch.promote_types(family.dtype, torch.float32)


def muon_param_groups(
    model: nn.Module, weight_decay: float, split_qkv: bool = True, base_groups: Optional[List[Dict]] = None
) -> List[Dict]:
    """megatron-core's split: Muon for the 2-D weights (one expert's tensor for a routed-expert stack) but the
    embedding tables and the output layer, AdamW for those and the rest. Each group of `base_groups` (default
    `weight_decay_groups(model, weight_decay)`: Megatron's no-decay rule for biases and norms) is split in two,
    keeping its settings (a decoupled lr, a weight decay). With `split_qkv` (Megatron's default) a fused QKV weight
    is orthogonalised per query, key and value block."""
    if base_groups is None:
        base_groups = weight_decay_groups(model, weight_decay)
    muon_rows = _muon_params(model, split_qkv)
    out = []
    for group in base_groups:
        by_split: Dict[Optional[Tuple[int, ...]], List] = {}
        adam = []
        for p in group["params"]:
            if id(p) in muon_rows:
                by_split.setdefault(muon_rows[id(p)], []).append(p)
            else:
                adam.append(p)
        for split, params in by_split.items():
            out.append(dict(group, params=params, muon=True, **({"muon_split_rows": split} if split else {})))
        if adam:
            out.append(dict(group, params=adam, muon=False))
    return out


def _muon_params(model: nn.Module, split_qkv: bool) -> Dict[int, Optional[Tuple[int, ...]]]:
    """{id(param): its row split or None} of the params Muon takes (megatron-core's get_megatron_muon_optimizer:
    2-D, not an embedding or the output layer, which it marks is_embedding_or_output_parameter)."""
    # at tp the tables are vocab-parallel, the output and qkv column-parallel: the rank's heads' split
    adam_only = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, VocabParallelEmbedding))}
    output = getattr(model, "output", None)
    if isinstance(getattr(output, "weight", None), nn.Parameter):
        adam_only.add(id(output.weight))
    qkv_splits = {}
    if split_qkv:
        for module in model.modules():
            qkv = getattr(module, "qkv", None)
            if (
                isinstance(qkv, (nn.Linear, ColumnParallelLinear))
                and hasattr(module, "heads")
                and hasattr(module, "groups")
            ):
                q, kv = module.heads * module.head_dim, module.groups * module.head_dim
                qkv_splits[id(qkv.weight)] = (q, kv, kv)
    out = {}
    for name, p in model.named_parameters():
        per_expert_ndim = p.ndim - (1 if is_expert_parallel(p) else 0)
        if per_expert_ndim == 2 and id(p) not in adam_only and not name.endswith(".bias"):
            out[id(p)] = qkv_splits.get(id(p))
    return out
