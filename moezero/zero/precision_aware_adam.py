"""PrecisionAwareAdam: AdamW (or Adam) that keeps its master weights and moments in narrower dtypes.

Megatron's `--use-precision-aware-optimizer`, with TransformerEngine FusedAdam's storage rules:
- moments (`exp_avg`, `exp_avg_sq`): fp32; bf16, stored as is; fp16 or fp8 (e4m3), stored divided by a
  per-tensor fp32 scale (amax over half the fp16 range, or over 448), recomputed at every step;
- the master weights of a bf16 or fp16 param: fp32, or fp16 scaled. The fp32 master of a bf16 param keeps
  only its 16 low bits (`store_param_remainders`): the param holds the high 16, rounded half away from zero,
  so the param and the remainder are the fp32 master exactly, in 2 bytes besides the param. An fp32 param
  is its own master.
The arithmetic is torch's fused Adam/AdamW kernel in fp32 on the unpacked values, so with every dtype fp32
a step equals torch.optim.AdamW(fused=True)'s. Unscaled states are unpacked a chunk at a time; a scaled one
needs its whole tensor's amax, so a param with one is stepped whole.

Under ZeroOptimizer each param is a piece of the model's own storage (`holds_master_weights`: no fp32
copy is made) and its gradient arrives as `decoupled_grad` in the main-grads dtype. A scaled state's scale
is per piece, so it depends on the sharding (as in Megatron); bf16 moments and remainders do not.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

FP8 = torch.float8_e4m3fn
SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2, FP8: 448.0}
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, FP8)
MASTER_DTYPES = (torch.float32, torch.float16)
MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}  # Megatron's
CHUNK = 1 << 20  # elements unpacked to fp32 at a time (bounds the step's scratch memory)


class PrecisionAwareAdam(torch.optim.Optimizer):
    """Args as torch.optim.AdamW, plus: `decoupled_weight_decay` (False: Adam's L2 penalty), the dtypes of the
    master weights and of each moment, `store_param_remainders` (see the module docstring) and
    `use_decoupled_grad` (read `p.decoupled_grad`, whose dtype may differ from the param's)."""

    holds_master_weights = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = True,
        use_decoupled_grad: bool = False,
    ):
        _check_dtype("master_weight_dtype", master_weight_dtype, MASTER_DTYPES)
        _check_dtype("exp_avg_dtype", exp_avg_dtype, MOMENT_DTYPES)
        _check_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype, MOMENT_DTYPES)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled_weight_decay = decoupled_weight_decay
        self.master_weight_dtype = master_weight_dtype
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.store_param_remainders = store_param_remainders
        self.use_decoupled_grad = use_decoupled_grad

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("PrecisionAwareAdam.step takes no closure")
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is not None:
                    self._step_param(p, grad.reshape(-1), group)

    def _step_param(self, p: torch.Tensor, grad: torch.Tensor, group: Dict) -> None:
        state = self.state[p]
        if not state:
            self._init_state(p, state)
        state["step"] += 1
        n = p.numel()
        whole = any(k + "_scale" in state for k in MOMENTS + ("master_param",))
        for lo in range(0, n, n if whole else CHUNK):
            part = slice(lo, min(n, lo + (n if whole else CHUNK)))
            master = self._unpack_master(p, state, part)
            moments = [_unpack(state[k], state.get(k + "_scale"), part) for k in MOMENTS]
            self._kernel(master, grad[part].float(), moments, state["step"], group)
            self._pack_master(p, state, part, master)
            for k, values in zip(MOMENTS, moments):
                _pack(state[k], state.get(k + "_scale"), part, values)

    def _kernel(self, master, grad, moments, step, group) -> None:
        kernel = torch._fused_adamw_ if self.decoupled_weight_decay else torch._fused_adam_
        beta1, beta2 = group["betas"]
        kernel(
            [master],
            [grad],
            [moments[0]],
            [moments[1]],
            [],
            [step],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )

    # ---- state -----------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, state: Dict) -> None:
        if not p.is_contiguous():
            raise ValueError("PrecisionAwareAdam steps contiguous params only")
        state["step"] = torch.tensor(0.0, device=p.device)  # the fused kernel reads it on its device
        for k in MOMENTS:
            dtype = self.moment_dtypes[k]
            state[k] = torch.zeros(p.numel(), dtype=dtype, device=p.device)
            if dtype in SCALED_RANGE:
                state[k + "_scale"] = torch.tensor(1.0)
        self._init_master(p, state, p.detach().reshape(-1).float())

    def _init_master(self, p: torch.Tensor, state: Dict, values: torch.Tensor) -> None:
        """The master state of a narrow param holding `values` (fp32; the param gets them, rounded)."""
        for k in ("master_param", "master_param_scale"):
            state.pop(k, None)
        if p.dtype == torch.float32:
            p.view(-1).copy_(values)
            return
        if self._keeps_remainders(p):
            state["master_param"] = torch.zeros(p.numel(), dtype=torch.int16, device=p.device)
        else:
            state["master_param"] = torch.empty(p.numel(), dtype=self.master_weight_dtype, device=p.device)
            if self.master_weight_dtype in SCALED_RANGE:
                state["master_param_scale"] = torch.tensor(1.0)
        self._pack_master(p, state, slice(0, p.numel()), values.clone())

    def _keeps_remainders(self, p: torch.Tensor) -> bool:
        return self.store_param_remainders and p.dtype == torch.bfloat16 and self.master_weight_dtype == torch.float32

    def _unpack_master(self, p: torch.Tensor, state: Dict, part: slice) -> torch.Tensor:
        """fp32 master values of `part` (the param's own storage for an fp32 param: stepped in place)."""
        flat = p.detach().view(-1)
        if "master_param" not in state:
            return flat[part] if p.dtype == torch.float32 else flat[part].float()
        stored = state["master_param"]
        if stored.dtype == torch.int16:
            high = flat[part].view(torch.int16).to(torch.int32).bitwise_left_shift_(16)
            return high.add_(stored[part]).view(torch.float32)
        return _unpack(stored, state.get("master_param_scale"), part)

    def _pack_master(self, p: torch.Tensor, state: Dict, part: slice, master: torch.Tensor) -> None:
        flat = p.detach().view(-1)
        stored = state.get("master_param")
        if stored is None:
            if p.dtype != torch.float32:
                flat[part].copy_(master)
            return
        if stored.dtype == torch.int16:
            bits = master.view(torch.int32)
            high = (bits + 0x8000).bitwise_right_shift_(16)
            stored[part].copy_(bits - high.bitwise_left_shift(16))
            flat[part].view(torch.int16).copy_(high)
            return
        flat[part].copy_(master)
        _pack(stored, state.get("master_param_scale"), part, master)

    # ---- full-precision view (checkpoints, norms) ---------------------------------------------------
    def master_values(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master weights of `p`, flat."""
        state = self.state.get(p, {})
        return self._unpack_master(p, state, slice(0, p.numel())).clone()

    def full_precision_state(self, p: torch.Tensor) -> Tuple[torch.Tensor, Dict]:
        """(fp32 master, torch AdamW's state with fp32 moments): what a checkpoint keeps, loadable by either."""
        state = self.state.get(p, {})
        out = {
            k: _unpack(state[k], state.get(k + "_scale"), slice(0, p.numel())).clone() for k in MOMENTS if k in state
        }
        if "step" in state:
            out["step"] = state["step"].clone()
        return self.master_values(p), out

    @torch.no_grad()
    def load_full_precision_state(self, p: torch.Tensor, master: torch.Tensor, saved: Optional[Dict]) -> None:
        """Adopt an fp32 master and an fp32 (or any-dtype) AdamW state for `p` (no state: not stepped yet)."""
        self.state.pop(p, None)
        if not saved:
            p.view(-1).copy_(master.reshape(-1))
            return
        state = self.state[p]
        self._init_state(p, state)
        state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).to(p.device, copy=True)
        for k in MOMENTS:
            _pack(state[k], state.get(k + "_scale"), slice(0, p.numel()), saved[k].reshape(-1).float().clone())
        self._init_master(p, state, master.reshape(-1).float().clone())


def _unpack(stored: torch.Tensor, scale: Optional[torch.Tensor], part: slice) -> torch.Tensor:
    """fp32 values of stored[part]; an fp32 state is returned as itself (updated in place)."""
    if stored.dtype == torch.float32:
        return stored[part]
    values = stored[part].float()
    return values.mul_(scale) if scale is not None else values


def _pack(stored: torch.Tensor, scale: Optional[torch.Tensor], part: slice, values: torch.Tensor) -> None:
    """Store fp32 `values` into stored[part] (a scaled state: the whole tensor, with a new scale)."""
    if stored.dtype == torch.float32:
        if values.data_ptr() != stored[part].data_ptr():
            stored[part].copy_(values)
        return
    if scale is not None:
        scale.copy_(values.abs().max() / SCALED_RANGE[stored.dtype] if values.numel() else 0.0)
        values.mul_(torch.where(scale > 0, scale.reciprocal(), 0.0))
    stored[part].copy_(values)


def _check_dtype(name: str, dtype: torch.dtype, allowed) -> None:
    if dtype not in allowed:
        raise ValueError(f"PrecisionAwareAdam: {name}={dtype} is not one of {', '.join(map(str, allowed))}")
