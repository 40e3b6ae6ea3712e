"""tools/bench_ops.py's rows for the CPU element-wise kernels (GELU, the experts' bias add, RMSNorm, SwiGLU and
GPT-OSS's quick GEGLU, the token cross-entropy), each forward + backward against torch's own version of the op."""

from __future__ import annotations

from typing import List

import torch

from moezero.moe.experts import QUICK_GELU_ALPHA
from moezero.ops.bias_add import _ExpertBiasOps, _FusedExpertBias
from moezero.ops.cross_entropy import token_cross_entropy
from moezero.ops.gelu import bias_gelu
from moezero.ops.rms_norm import rms_norm
from moezero.ops.swiglu import quick_geglu, swiglu
from tools.bench.op_timing import COMPILED, DTYPES, Row, median_ms


def gelu_rows(ext, args, device) -> List[Row]:
    """The fused bias + GELU (one expert block, CPU), forward + backward, against torch's GELU of the bias add."""
    if device != "cpu":
        return []
    rows = []
    for dname in args.dtypes:
        y = torch.randn(args.tokens // 8, args.hidden, device=device).to(DTYPES[dname])
        bias, grad = torch.randn(1, args.hidden).to(y.dtype), torch.randn_like(y)
        for approximate in ("none", "tanh"):

            def step(gelu_of_bias_add, a=approximate):
                y_in, b_in = y.clone().requires_grad_(), bias.clone().requires_grad_()
                out = gelu_of_bias_add(y_in, b_in, a)
                out.backward(grad)
                return out.detach(), y_in.grad, b_in.grad

            fused = lambda: step(lambda y_in, b_in, a: bias_gelu(y_in, b_in, [y.shape[0]], approximate=a))
            plain = lambda: step(lambda y_in, b_in, a: torch.nn.functional.gelu(y_in + b_in, approximate=a))
            for got, want in zip(fused(), plain()):  # the bias gradient sums rows: within 2% of its largest
                assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
            timed = median_ms({COMPILED: fused, "gelu(y + b)": plain}, args.reps, device)
            rows.append(
                (
                    f"bias_gelu fwd+bwd ({approximate})",
                    f"{dname} {y.shape[0]} x {args.hidden}",
                    timed[COMPILED],
                    "gelu(y + b)",
                    timed["gelu(y + b)"],
                )
            )
    return rows


class _BiasPerExpert(torch.autograd.Function):
    """What the experts did before the kernel: one broadcast add per expert, one `sum` per expert in backward."""

    @staticmethod
    def forward(ctx, y, bias, counts):
        ctx.counts = counts
        return torch.cat([rows + bias[l] for l, rows in enumerate(y.split(counts))])

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.stack([block.sum(0) for block in grad.split(ctx.counts)]), None


def bias_add_rows(ext, args, device) -> List[Row]:
    """Each expert's bias on its rows (the experts' b2; b1 under SwiGLU), forward + backward, at each --experts
    (--tokens // 8 rows spread over them), against the torch ops of other devices and one add and sum per expert."""
    if device != "cpu":
        return []
    rows = []
    for dname in args.dtypes:
        for E in args.experts:
            g = torch.Generator().manual_seed(0)
            y = torch.randn(args.tokens // 8, args.hidden, generator=g).to(DTYPES[dname])
            counts = torch.randint(0, E, (y.shape[0],), generator=g).bincount(minlength=E).tolist()
            bias, grad = torch.randn(E, args.hidden, generator=g).to(y.dtype), torch.randn_like(y)

            def step(function):
                y_in, b_in = y.clone().requires_grad_(), bias.clone().requires_grad_()
                out = function.apply(y_in, b_in, counts)
                out.backward(grad)
                return out.detach(), y_in.grad, b_in.grad

            candidates = {
                "torch ops (no kernel, GPU)": lambda: step(_ExpertBiasOps),
                "add and sum per expert": lambda: step(_BiasPerExpert),
            }
            for candidate in candidates.values():  # the bias gradient sums rows in another order
                for got, want in zip(step(_FusedExpertBias), candidate()):
                    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
            timed = median_ms({COMPILED: lambda: step(_FusedExpertBias), **candidates}, args.reps, device)
            for name in candidates:  # a row each: the other devices' path, and what it replaced
                rows.append(
                    (
                        "expert bias add fwd+bwd",
                        f"{dname} {y.shape[0]} x {args.hidden}, E={E}",
                        timed[COMPILED],
                        name,
                        timed[name],
                    )
                )
    return rows


def rms_norm_rows(ext, args, device) -> List[Row]:
    """RMSNorm forward + backward over --tokens // 8 rows of --hidden (CPU), against torch's F.rms_norm (a composite
    on the CPU)."""
    if device != "cpu":
        return []
    rows = []
    for dname in args.dtypes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.tokens // 8, args.hidden, generator=g).to(DTYPES[dname])
        weight, grad = (torch.rand(args.hidden, generator=g) + 0.5).to(x.dtype), torch.randn_like(x)

        def step(norm):
            x_in, w_in = x.clone().requires_grad_(), weight.clone().requires_grad_()
            out = norm(x_in, [args.hidden], w_in, 1e-5)
            out.backward(grad)
            return out.detach(), x_in.grad, w_in.grad

        for got, want in zip(step(rms_norm), step(torch.nn.functional.rms_norm)):
            assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
        timed = median_ms(
            {COMPILED: lambda: step(rms_norm), "F.rms_norm": lambda: step(torch.nn.functional.rms_norm)},
            args.reps,
            device,
        )
        rows.append(
            (
                "rms_norm fwd+bwd",
                f"{dname} {x.shape[0]} x {args.hidden}",
                timed[COMPILED],
                "F.rms_norm",
                timed["F.rms_norm"],
            )
        )
    return rows


def _torch_quick_geglu(h):
    """GPT-OSS's clamped quick GEGLU as torch's ops (experts.activation without the kernel)."""
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return gate * torch.sigmoid(QUICK_GELU_ALPHA * gate) * (up + 1.0)


# (row name, the kernel, torch's ops, what they are called)
GATED = (
    (
        "swiglu fwd+bwd",
        swiglu,
        lambda h: torch.nn.functional.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1],
        "silu(gate) * up",
    ),
    (
        "quick_geglu fwd+bwd",
        lambda h: quick_geglu(h, QUICK_GELU_ALPHA, 1.0, 7.0),
        _torch_quick_geglu,
        "clamps, sigmoid, 3 mul, add",
    ),
)


def swiglu_rows(ext, args, device) -> List[Row]:
    """The gated activations forward + backward over --tokens // 8 rows of [gate | up] (2 x --hidden; CPU): SwiGLU
    against torch's chunk, silu and mul; GPT-OSS's quick GEGLU (offset 1, clamp 7) against its chain of ops."""
    if device != "cpu":
        return []
    rows = []
    for dname in args.dtypes:
        g = torch.Generator().manual_seed(0)
        h = (torch.randn(args.tokens // 8, 2 * args.hidden, generator=g) * 2).to(DTYPES[dname])
        grad = torch.randn(h.shape[0], args.hidden, generator=g).to(h.dtype)
        for name, fused, ops, ops_name in GATED:

            def step(activation):
                h_in = h.clone().requires_grad_()
                out = activation(h_in)
                out.backward(grad)
                return out.detach(), h_in.grad

            for got, want in zip(step(fused), step(ops)):
                assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
            timed = median_ms({COMPILED: lambda: step(fused), ops_name: lambda: step(ops)}, args.reps, device)
            rows.append((name, f"{dname} {h.shape[0]} x {h.shape[1]}", timed[COMPILED], ops_name, timed[ops_name]))
    return rows


def cross_entropy_rows(ext, args, device) -> List[Row]:
    """The fused token cross-entropy (--cross-entropy-loss-fusion), forward + backward, against F.cross_entropy on
    the logits widened to fp32 (the unfused loss), at each --vocab, --tokens // 8 rows."""
    if device != "cpu":
        return []
    rows = []
    for dname in args.dtypes:
        for vocab in args.vocab:
            g = torch.Generator().manual_seed(0)
            logits = torch.randn(args.tokens // 8, vocab, generator=g).to(DTYPES[dname])
            labels = torch.randint(0, vocab, (logits.shape[0],), generator=g)

            def step(fused):
                x = logits.clone().requires_grad_()
                losses = token_cross_entropy(x, labels, fused=fused)
                losses.mean().backward()
                return losses.detach(), x.grad

            for got, want in zip(step(True), step(False)):
                assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
            timed = median_ms(
                {COMPILED: lambda: step(True), "cross_entropy(x.float())": lambda: step(False)}, args.reps, device
            )
            rows.append(
                (
                    "cross_entropy fwd+bwd",
                    f"{dname} {logits.shape[0]} x {vocab}",
                    timed[COMPILED],
                    "cross_entropy(x.float())",
                    timed["cross_entropy(x.float())"],
                )
            )
    return rows
