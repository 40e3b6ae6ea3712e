"""Local experts as stacked weights: a grouped GEMM fast path and a per-expert loop reference.

Shapes: M rows for the local experts (sorted by expert), L local experts, D hidden, F expert
FFN width (2F for the fused SwiGLU input projection), P rows once each expert's are padded to
its size class (row_size_class).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moezero.config import MoEConfig, expert_ffn_size
from moezero.ops.bias_add import add_expert_bias
from moezero.ops.gelu import bias_gelu, fused_gelu_applies
from moezero.ops.swiglu import fused_glu_applies, quick_geglu, swiglu
from moezero.parallel import comm
from moezero.parallel.expert_marker import ExpertShard, mark_expert_parallel
from moezero.parallel.tensor_marker import TensorShard, mark_tensor_parallel

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Row size classes. Dropless routing gives every expert a new row count every step, and oneDNN (the CPU's
# bf16 GEMMs) builds and caches a primitive per GEMM shape, up to 1,024 of them: bf16 training held far more
# memory than fp32 (issue 24). Rounding rows up to a multiple of 2^(floor(log2 rows) - 2) gives four classes per
# power of two and at most 25% padding, so a run meets O(log max rows) shapes. Up to 8 rows are one class: there
# a bf16 GEMM costs about the same whatever its rows (a GEMM that small is all overhead).
_SMALLEST_ROW_CLASS = 8


# GELU kinds -> torch's `approximate`: "gelu_tanh" is Megatron's fused bias-GELU (GPTConfig.mlp_activation)
_GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}
GATED = ("swiglu", "quick_geglu")  # input projection [gate | up]: act(gate) * (up + offset)
ACTIVATIONS = ("gelu", "gelu_tanh") + GATED
QUICK_GELU_ALPHA = 1.702  # quick GELU: x sigmoid(1.702 x)


def activation(h_MF: torch.Tensor, kind: str, offset: float = 0.0, clamp: Optional[float] = None) -> torch.Tensor:
    """The MLP's activation; a gated one (Megatron's glu) with its up projection's `offset` and, with `clamp`,
    the gate clamped above and the up projection to +-clamp first (GPT-OSS's)."""
    if kind in GATED and fused_glu_applies(h_MF):
        if kind == "quick_geglu":
            return quick_geglu(h_MF, QUICK_GELU_ALPHA, offset, clamp)
        if clamp is None and not offset:
            return swiglu(h_MF)
    if kind in GATED:
        gate, up = h_MF.chunk(2, dim=-1)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        gated = F.silu(gate) if kind == "swiglu" else gate * torch.sigmoid(QUICK_GELU_ALPHA * gate)
        return gated * (up + offset) if offset else gated * up
    approximate = _GELU_APPROXIMATE[kind]
    if fused_gelu_applies(h_MF):
        return bias_gelu(h_MF, approximate=approximate)
    return F.gelu(h_MF, approximate=approximate)


def biased_activation(
    y_MF: torch.Tensor,
    b_LF: Optional[torch.Tensor],
    counts: List[int],
    kind: str,
    offset: float = 0.0,
    clamp: Optional[float] = None,
) -> torch.Tensor:
    """activation(y + each expert's bias on its rows); GELU adds the bias in its own pass where it is fused."""
    if kind in _GELU_APPROXIMATE and fused_gelu_applies(y_MF, b_LF):
        return bias_gelu(y_MF, b_LF, counts, _GELU_APPROXIMATE[kind])
    return activation(_add_bias(y_MF, b_LF, counts), kind, offset, clamp)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (torch._grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_supported(x_MD: torch.Tensor, w_LDF: torch.Tensor) -> bool:
    """torch._grouped_mm needs fp32/bf16/fp16, rows on 16-byte strides and aligned storage, M > 0."""
    if not hasattr(torch, "_grouped_mm") or x_MD.dtype not in _GROUPED_MM_DTYPES or w_LDF.dtype != x_MD.dtype:
        return False
    if torch.compiler.is_compiling() and x_MD.device.type == "cpu":
        return False  # its meta function (what torch.compile traces with) accepts only bf16 on the CPU
    elt = x_MD.element_size()
    sizes_ok = all((n * elt) % 16 == 0 for n in (x_MD.shape[1], w_LDF.shape[2]))
    ptrs_ok = x_MD.data_ptr() % 16 == 0 and w_LDF.data_ptr() % 16 == 0
    return x_MD.shape[0] > 0 and sizes_ok and ptrs_ok and x_MD.is_contiguous()


def grouped_mm(x_MD: torch.Tensor, w_LDF: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """Rows of expert l (consecutive, counts[l] of them) times w_LDF[l], as one grouped GEMM."""
    offs = torch.tensor(counts, dtype=torch.int32, device=x_MD.device).cumsum(0, dtype=torch.int32)
    return _ContiguousGrad.apply(torch._grouped_mm(x_MD, w_LDF, offs=offs))


def loop_mm(x_MD: torch.Tensor, w_LDF: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """The reference: one matmul per expert."""
    chunks = torch.split(x_MD, counts, dim=0)
    return torch.cat([chunk @ w_LDF[l] for l, chunk in enumerate(chunks)], dim=0)


def row_size_class(rows: int) -> int:
    """`rows` rounded up to its size class: 0 stays 0, 1-8 become 8, more a multiple of 2^(floor(log2 rows) - 2)."""
    if rows == 0:
        return 0
    if rows <= _SMALLEST_ROW_CLASS:
        return _SMALLEST_ROW_CLASS
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def padded_positions(counts: List[int], padded: List[int], device: torch.device) -> torch.Tensor:
    """Where each of the M rows goes when expert l's block grows from counts[l] to padded[l] rows (its rows first)."""
    gaps = [p - n for p, n in zip(padded, counts)]
    shift_L = torch.tensor([0] + gaps[:-1], dtype=torch.long, device=device).cumsum(0)
    rows = sum(counts)
    return torch.arange(rows, device=device) + torch.repeat_interleave(
        shift_L, torch.tensor(counts, device=device), output_size=rows
    )


def expert_mm(
    x_MD: torch.Tensor,
    w_LDF: torch.Tensor,
    counts: List[int],
    use_grouped: bool,
    deferred: Optional["DeferredWeightGrads"] = None,
) -> torch.Tensor:
    """Rows of expert l times w_LDF[l]; with `deferred`, w's gradient is left to it (--delay-wgrad-compute)."""
    grouped = use_grouped and grouped_mm_supported(x_MD, w_LDF)
    if deferred is not None:
        return _InputGradOnlyMM.apply(x_MD, w_LDF, counts, grouped, deferred)
    return grouped_mm(x_MD, w_LDF, counts) if grouped else loop_mm(x_MD, w_LDF, counts)


class DeferredWeightGrads:
    """--delay-wgrad-compute (Megatron's): one forward's expert GEMMs give autograd their input gradients only,
    keeping (input, output gradient) here; the weights' gradients are computed by a node of their own, made where
    the MoE layer makes this object (after launching the rows' all-to-all), which autograd, taking the latest-made
    node first, reaches after it launched that all-to-all's gradient and before it waits for it. The same GEMMs
    as autograd's own backward (the same numbers)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        self.weights = [w1, w2]
        self.kept: dict = {}
        self.trigger = _WeightGradNode.apply(self, *self.weights)

    def slot_of(self, w: torch.Tensor) -> int:
        for i, weight in enumerate(self.weights):
            if weight is w:
                return i
        raise RuntimeError(
            "--delay-wgrad-compute: an expert GEMM ran with a weight its DeferredWeightGrads "
            "did not read (pass the experts' forward the object it was made with)"
        )

    def keep(self, slot: int, x_MD, grad_MF, counts: List[int], grouped: bool) -> None:
        self.kept[slot] = (x_MD, grad_MF, counts, grouped)

    def weight_grads(self) -> List[torch.Tensor]:
        if len(self.kept) != len(self.weights):  # autograd reaches this node after the GEMMs' backward
            raise RuntimeError(
                "--delay-wgrad-compute: the experts' weight gradients were asked for before their GEMMs' backward ran"
            )
        return [_weight_grad(*self.kept.pop(slot)) for slot in range(len(self.weights))]

    def attach(self, y: torch.Tensor) -> torch.Tensor:
        """`y` unchanged, with the weights' node in its graph (its gradient reaches the node as a zero)."""
        return _Attach.apply(y, self.trigger)


def _weight_grad(x_MD: torch.Tensor, grad_MF: torch.Tensor, counts: List[int], grouped: bool) -> torch.Tensor:
    if grouped:
        offs = torch.tensor(counts, dtype=torch.int32, device=x_MD.device).cumsum(0, dtype=torch.int32)
        return torch._grouped_mm(x_MD.t(), grad_MF, offs=offs)
    pairs = zip(torch.split(x_MD, counts), torch.split(grad_MF, counts))
    return torch.stack([x.t().mm(g) for x, g in pairs])


class _InputGradOnlyMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, w_LDF, counts, grouped, deferred):
        ctx.save_for_backward(x_MD, w_LDF)
        ctx.counts, ctx.grouped, ctx.deferred, ctx.slot = counts, grouped, deferred, deferred.slot_of(w_LDF)
        return grouped_mm(x_MD, w_LDF, counts) if grouped else loop_mm(x_MD, w_LDF, counts)

    @staticmethod
    def backward(ctx, grad_MF):
        x_MD, w_LDF = ctx.saved_tensors
        grad_MF = grad_MF.contiguous()
        ctx.deferred.keep(ctx.slot, x_MD, grad_MF, ctx.counts, ctx.grouped)
        w_FD = w_LDF.transpose(-2, -1)
        if ctx.grouped:
            offs = torch.tensor(ctx.counts, dtype=torch.int32, device=x_MD.device).cumsum(0, dtype=torch.int32)
            grad_MD = torch._grouped_mm(grad_MF, w_FD, offs=offs)
        else:
            grad_MD = torch.cat([g.mm(w_FD[l]) for l, g in enumerate(torch.split(grad_MF, ctx.counts))])
        return grad_MD, None, None, None, None


class _WeightGradNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, deferred, *weights):
        ctx.deferred = deferred
        return weights[0].new_zeros(())

    @staticmethod
    def backward(ctx, _zero):
        return (None, *ctx.deferred.weight_grads())


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, trigger):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(())


class GroupedExperts(nn.Module):
    """The L = num_experts / ep experts this rank holds, stacked along dim 0 and tagged expert-parallel.

    Under expert tensor parallelism (an `etp` group of R ranks, Megatron's ETP) each expert's ffn dim is split over
    the group: w1 column-parallel (rank r holds block r of F, of the gate and the up half each under a GLU), w2
    row-parallel, so the output is the rank's partial sum, which the dispatcher reduce-scatters over etp. b1 is split
    as w1. b2 is split along D: rank r adds its block of columns to its partial output (zeros elsewhere), so after
    the sum each column got its bias once, and its gradient (the output gradient, whole on every etp rank: the
    reduce-scatter's backward gathers it) is each element's full gradient on the one rank that holds it. Every
    split param carries a TensorShard beside its ExpertShard, so optimizer pieces and init sit at global
    coordinates.

    Args:
        config: the layer's MoEConfig.
        shard: which global experts these are (ep rank and size).
        etp: the expert-tensor-parallel group (None: each expert whole here).
    """

    def __init__(self, config: MoEConfig, shard: ExpertShard, etp: Optional[Any] = None):
        super().__init__()
        L, D, Fw = shard.num_local_experts, config.hidden_size, expert_ffn_size(config)
        self.etp_size, self.etp_rank = comm.group_size(etp), comm.group_rank(etp)
        parts = (Fw, Fw) if config.activation in GATED else (Fw,)
        fan_out = sum(parts)
        self.activation = config.activation
        self.offset, self.clamp = config.glu_linear_offset, config.activation_clamp
        self.use_grouped = config.grouped_gemm
        self.delay_wgrad = config.delay_wgrad_compute
        self.pad_rows = config.pad_expert_rows
        self.tensor_shards: Dict[str, TensorShard] = {}
        if self.etp_size > 1:
            R, r = self.etp_size, self.etp_rank
            if Fw % R or D % R:
                raise ValueError(
                    f"expert tensor parallel size {R} must divide the expert ffn size ({Fw}) and the hidden size ({D})"
                )
            self.tensor_shards = {
                "w1": TensorShard.split((L, D, fan_out), 2, r, R, parts),
                "w2": TensorShard.split((L, Fw, D), 1, r, R),
                "b1": TensorShard.split((L, fan_out), 1, r, R, parts),
                "b2": TensorShard.split((L, D), 1, r, R),
            }
        self.w1 = nn.Parameter(torch.empty(self._local_shape("w1", (L, D, fan_out))))
        self.w2 = nn.Parameter(torch.empty(self._local_shape("w2", (L, Fw, D))))
        bias = config.bias  # Megatron's add_bias_linear
        self.b1 = nn.Parameter(torch.zeros(self._local_shape("b1", (L, fan_out)))) if bias else None
        self.b2 = nn.Parameter(torch.zeros(self._local_shape("b2", (L, D)))) if bias else None
        self.shard = shard
        self._mark_expert_parallel()

    def _local_shape(self, name: str, shape: Tuple[int, ...]) -> Tuple[int, ...]:
        shard = self.tensor_shards.get(name)
        return shape if shard is None else shard.local_shape

    def _mark_expert_parallel(self) -> None:
        for name in ("w1", "w2", "b1", "b2"):
            w = getattr(self, name)
            if w is not None:
                mark_expert_parallel(w, self.shard)
                if name in self.tensor_shards:
                    mark_tensor_parallel(w, self.tensor_shards[name])

    def __setstate__(self, state) -> None:
        """A copy (copy.deepcopy, a pickled module) holds expert weights too: torch's Parameter copy drops the tag."""
        super().__setstate__(state)
        self._mark_expert_parallel()

    def defer_weight_grads(self) -> Optional[DeferredWeightGrads]:
        """With --delay-wgrad-compute in a forward that builds a graph: where the weights' gradients will be
        computed (the MoE layer makes it after launching the rows' all-to-all); else None."""
        if not (self.delay_wgrad and torch.is_grad_enabled()):
            return None
        w1, w2 = self.w1, self.w2  # read once: under QAT each read fake-quantizes the weight
        return DeferredWeightGrads(w1, w2) if w1.requires_grad or w2.requires_grad else None

    def forward(
        self, x_MD: torch.Tensor, counts: List[int], deferred: Optional[DeferredWeightGrads] = None
    ) -> torch.Tensor:
        if not (self.pad_rows and x_MD.device.type == "cpu"):  # GPU GEMMs cache nothing per shape: it only adds work
            return self._ffn(x_MD, counts, deferred)
        # each expert's rows padded to its size class with zero rows, whose outputs are dropped: their gradients
        # are zero, so every GEMM (forward and backward) has a class's shape and the numbers are unchanged
        padded = [row_size_class(n) for n in counts]
        rows_M = padded_positions(counts, padded, x_MD.device)
        x_PD = x_MD.new_zeros(sum(padded), x_MD.shape[1]).index_copy(0, rows_M, x_MD)
        return self._ffn(x_PD, padded, deferred).index_select(0, rows_M)

    def _ffn(
        self, x_MD: torch.Tensor, counts: List[int], deferred: Optional[DeferredWeightGrads] = None
    ) -> torch.Tensor:
        # with `deferred`, the weights it read: a parametrized weight (QAT) is a new tensor at every read
        w1, w2 = (self.w1, self.w2) if deferred is None else deferred.weights
        a = biased_activation(
            expert_mm(x_MD, w1, counts, self.use_grouped, deferred),
            self.b1,
            counts,
            self.activation,
            self.offset,
            self.clamp,
        )
        y = _add_bias(expert_mm(a, w2, counts, self.use_grouped, deferred), self._fc2_bias(), counts)
        return y if deferred is None else deferred.attach(y)

    def _fc2_bias(self) -> Optional[torch.Tensor]:
        """b2 over all D columns: under ETP the rank's block of them, zeros elsewhere (added once over the sum)."""
        shard = self.tensor_shards.get("b2")
        if self.b2 is None or shard is None:
            return self.b2
        (lo, hi), D = shard.blocks[0], shard.global_shape[1]
        return F.pad(self.b2, (lo, D - hi))


def _add_bias(y_MF: torch.Tensor, b_LF: Optional[torch.Tensor], counts: List[int]) -> torch.Tensor:
    """Each expert's bias added to its rows (rows are grouped by expert, counts[l] of them)."""
    return y_MF if b_LF is None else add_expert_bias(y_MF, b_LF, counts)


class DenseMLP(nn.Module):
    """A plain MLP (the shared expert, and the dense layers of the GPT model)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        activation_kind: str,
        bias: bool = False,
        offset: float = 0.0,
        clamp: Optional[float] = None,
    ):
        super().__init__()
        if activation_kind not in ACTIVATIONS:
            raise ValueError(f"activation {activation_kind!r}: must be one of {', '.join(ACTIVATIONS)}")
        fan_out = 2 * ffn_hidden_size if activation_kind in GATED else ffn_hidden_size
        self.activation, self.offset, self.clamp = activation_kind, offset, clamp
        self.fc1 = nn.Linear(hidden_size, fan_out, bias=bias)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.fc1(x), self.activation, self.offset, self.clamp))
