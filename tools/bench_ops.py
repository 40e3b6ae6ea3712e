"""Time each compiled moezero kernel against the best pure-PyTorch version of the same op.

    python tools/bench_ops.py                      # CPU, 16k tokens, hidden 1024, E = 8 and 64, k = 2
    python tools/bench_ops.py --device cuda        # the CUDA kernels
    python tools/bench_ops.py --reps 3 --skip-layer

For every op, dtype and E it prints the compiled kernel's time, the fastest of several
pure-torch formulations (the reference of moezero/ops/reference.py is only one of them; the
others use index_add_ / bmm / one-hot ranks / torch._foreach_* / out= kernels) and the ratio
best-torch / compiled (> 1: the compiled kernel wins). Every candidate is checked against the
reference once, so no baseline is faster because it computes something else. A "permute (index
only)" row (D = 1) shows the counting sort against argsort without the row copy, which is
memory-bound and, on CPU, mostly page faults of the freshly allocated output. Then it times an
end-to-end MoELayer forward + backward with the extension and with MOEZERO_DISABLE_EXT=1.
The fused bias + GELU rows time forward and backward together (the kernel saves gelu'(h) so that the
backward is one multiply); the expert bias add rows time the one-pass add and sums against
the torch ops other devices run and one op per expert; the rms_norm and swiglu rows the kernels against
torch's RMSNorm and silu(gate) * up, forward and backward.
The dispatch rows time the public ops' eager path against the same kernels through their torch.library custom
ops. Times are medians over --reps runs; other processes on the machine make them noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Tuple

import torch

from moezero import ops
from moezero.ops import _library, _loader, eager, reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tools.bench.elementwise_rows import (
    bias_add_rows,
    cross_entropy_rows,
    gelu_rows,
    rms_norm_rows,  # noqa: E402
    swiglu_rows,
)
from tools.bench.op_timing import COMPILED, DTYPES, Row, median_ms  # noqa: E402


def routing(T: int, K: int, E: int, device: str) -> torch.Tensor:
    """Distinct top-k experts per token, as a router gives, no drops (the common case)."""
    g = torch.Generator().manual_seed(0)
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].contiguous().to(device)


def permute_onehot(x_TD, ids_TK, E):
    """Rank within expert by a cumsum over one-hot rows (tutel/GShard style), then a gather."""
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1)
    onehot = torch.nn.functional.one_hot(flat.clamp_min(0), E) * (flat >= 0).unsqueeze(1)
    counts = onehot.sum(0)
    starts = torch.cumsum(counts, 0) - counts
    rank = (torch.cumsum(onehot, 0) * onehot).sum(1) - 1
    row_map = torch.where(flat >= 0, starts[flat.clamp_min(0)] + rank, -1)
    src = torch.empty(int(counts.sum()), dtype=torch.int64, device=x_TD.device)
    kept = flat >= 0
    src[row_map[kept]] = torch.arange(T * K, device=x_TD.device)[kept] // K
    return x_TD.index_select(0, src), counts, row_map.view(T, K)


def combine_bmm(y_ND, row_map_TK, w_TK):
    """Gather the K rows of each token and reduce them with one batched (1 x K) @ (K x D)."""
    T, K = row_map_TK.shape
    acc = torch.promote_types(y_ND.dtype, torch.float32)
    g = y_ND.index_select(0, row_map_TK.reshape(-1)).view(T, K, -1).to(acc)
    return torch.bmm(w_TK.to(acc).unsqueeze(1), g).squeeze(1).to(y_ND.dtype)


def combine_index_add(y_ND, row_map_TK, w_TK):
    """Scatter-add every weighted row into its token (Megatron's unpermute style)."""
    T, K = row_map_TK.shape
    acc = torch.promote_types(y_ND.dtype, torch.float32)
    token_N = torch.empty(y_ND.shape[0], dtype=torch.int64, device=y_ND.device)
    w_N = torch.empty(y_ND.shape[0], dtype=acc, device=y_ND.device)
    token_N[row_map_TK.reshape(-1)] = torch.arange(T * K, device=y_ND.device) // K
    w_N[row_map_TK.reshape(-1)] = w_TK.reshape(-1).to(acc)
    out = torch.zeros(T, y_ND.shape[1], dtype=acc, device=y_ND.device)
    return out.index_add_(0, token_N, y_ND.to(acc) * w_N.unsqueeze(1)).to(y_ND.dtype)


def combine_backward_bmm(grad_TD, y_ND, row_map_TK, w_TK):
    """grad_y by one index_copy_ of the weighted token grads; grad_w as a batched dot (bmm)."""
    T, K = row_map_TK.shape
    acc = torch.promote_types(y_ND.dtype, torch.float32)
    rows = row_map_TK.reshape(-1)
    g = grad_TD.to(acc)
    grad_y = torch.empty_like(y_ND)
    grad_y.index_copy_(0, rows, (g.unsqueeze(1) * w_TK.to(acc).unsqueeze(2)).reshape(T * K, -1).to(y_ND.dtype))
    yk = y_ND.index_select(0, rows).view(T, K, -1).to(acc)
    grad_w = torch.bmm(yk, g.unsqueeze(2)).squeeze(2).to(w_TK.dtype)
    return grad_y, grad_w


def flatten_out(flat, tensors, offsets, scale, accumulate):
    """One fused kernel per tensor: torch.mul(..., out=view) or view.add_(src, alpha=scale)."""
    for t, o in zip(tensors, offsets):
        view = flat[o : o + t.numel()]
        src = t.reshape(-1)
        if accumulate:
            view.add_(src, alpha=scale)
        else:
            torch.mul(src, scale, out=view)


def sum_of_squares_foreach(tensors):
    """torch._foreach_norm with an fp32 accumulation dtype (no cast copies), squared and summed."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


def sum_of_squares_dot(tensors):
    """Per-tensor vector_norm in fp32 (BLAS-like reduction), squared and summed."""
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]).square().sum()


# ---- op table -------------------------------------------------------------------------------


def compare(
    ext, op: str, args, candidates: Dict[str, Callable], reps: int, device: str, check: Callable = None
) -> Tuple[float, str, float]:
    if check is not None:
        for fn in candidates.values():
            check(fn(*args), getattr(reference, op)(*args))
    fns = {name: (lambda fn=fn: fn(*args)) for name, fn in candidates.items()}
    fns[COMPILED] = lambda: getattr(ext, op)(*args)
    timed = median_ms(fns, reps, device)
    compiled_ms = timed.pop(COMPILED)
    best = min(timed, key=timed.get)
    return compiled_ms, best, timed[best]


def close(got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def routing_rows(ext, args, device) -> List[Row]:
    rows = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for E in args.experts:
            cfg = f"{dname} T={args.tokens} D={args.hidden} E={E} k={args.topk}"
            x = torch.randn(args.tokens, args.hidden, device=device).to(dtype)
            ids = routing(args.tokens, args.topk, E, device)
            res = compare(
                ext,
                "permute",
                (x, ids, E),
                {"reference(argsort)": reference.permute, "onehot-cumsum": permute_onehot},
                args.reps,
                device,
                close,
            )
            rows.append(("permute", cfg) + res)
            if dname == args.dtypes[0]:  # D = 1: the counting sort alone, without the row copy
                res = compare(
                    ext,
                    "permute",
                    (x[:, :1].contiguous(), ids, E),
                    {"reference(argsort)": reference.permute, "onehot-cumsum": permute_onehot},
                    args.reps,
                    device,
                    close,
                )
                rows.append(("permute (index only)", cfg.replace(f"D={args.hidden}", "D=1")) + res)
            y, _, row_map = reference.permute(x, ids, E)
            w = torch.rand(args.tokens, args.topk, device=device).softmax(-1)
            res = compare(
                ext,
                "unpermute_combine",
                (y, row_map, w),
                {
                    "reference(einsum)": reference.unpermute_combine,
                    "gather+bmm": combine_bmm,
                    "index_add_": combine_index_add,
                },
                args.reps,
                device,
                close,
            )
            rows.append(("unpermute_combine", cfg) + res)
            grad = torch.randn_like(x)
            res = compare(
                ext,
                "unpermute_combine_backward",
                (grad, y, row_map, w),
                {"reference": reference.unpermute_combine_backward, "index_copy_+bmm": combine_backward_bmm},
                args.reps,
                device,
                close,
            )
            rows.append(("unpermute_combine_backward", cfg) + res)
    return rows


def bucket_params(hidden: int, layers: int, device: str, dtype) -> List[torch.Tensor]:
    """The gradients of `layers` GPT blocks: big matrices plus small biases and norms."""
    shapes = []
    for _ in range(layers):
        shapes += [
            (3 * hidden, hidden),
            (3 * hidden,),
            (hidden, hidden),
            (hidden,),
            (4 * hidden, hidden),
            (4 * hidden,),
            (hidden, 4 * hidden),
            (hidden,),
            (hidden,),
            (hidden,),
            (hidden,),
            (hidden,),
        ]
    return [torch.randn(s, device=device).to(dtype) for s in shapes]


def bucket_rows(ext, args, device) -> List[Row]:
    rows = []
    for src_name, flat_name, accumulate in (
        ("fp32", "fp32", False),
        ("bf16", "fp32", False),
        ("fp32", "fp32", True),
        ("bf16", "bf16", False),
    ):
        grads = bucket_params(args.hidden, args.layers, device, DTYPES[src_name])
        offsets, total = [], 0
        for g in grads:
            offsets.append(total)
            total += g.numel()
        flat = torch.zeros(total, device=device, dtype=DTYPES[flat_name])
        cfg = f"{src_name}->{flat_name} {'add' if accumulate else 'copy'} x0.5 {total / 1e6:.1f}M elems"
        res = compare(
            ext,
            "flatten_into",
            (flat, grads, offsets, 0.5, accumulate),
            {"reference(_foreach)": reference.flatten_into, "per-tensor out=": flatten_out},
            args.reps,
            device,
        )
        rows.append(("flatten_into", cfg) + res)
    for dname in args.dtypes:
        grads = bucket_params(args.hidden, args.layers, device, DTYPES[dname])
        cfg = f"{dname} {sum(g.numel() for g in grads) / 1e6:.1f}M elems in {len(grads)} tensors"
        res = compare(
            ext,
            "sum_of_squares",
            (grads,),
            {
                "reference": reference.sum_of_squares,
                "_foreach_norm(dtype=fp32)": sum_of_squares_foreach,
                "vector_norm each": sum_of_squares_dot,
            },
            args.reps,
            device,
            lambda g, w: torch.testing.assert_close(g, w, rtol=1e-4, atol=0),
        )
        rows.append(("sum_of_squares", cfg) + res)
    return rows


def dispatch_rows(args, device) -> List[Row]:
    """The public ops called as a step calls them, on the eager path (ops/eager.py) against the torch.library custom
    ops (what torch.compile traces): the MoE round trip (permute, combine, forward + backward) at a small rank's
    share and the gradient staging of a layer's worth of small tensors, where the per-call cost shows."""

    def custom_ops(fn):
        def run():
            applies, eager.applies = eager.applies, lambda *tensors: False
            try:
                return fn()
            finally:
                eager.applies = applies

        return run

    rows = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for T, D, E in ((256, 256, 4), (2048, 1024, 8)):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
            w = torch.rand(T, args.topk, generator=g).to(device, dtype).requires_grad_()
            ids = routing(T, args.topk, E, device)

            def round_trip():
                x.grad = w.grad = None
                x_ND, _, row_map = ops.permute_tokens(x, ids, E)
                out = ops.unpermute_combine(x_ND * 2, row_map, w)
                out.sum().backward()
                return out.detach(), x.grad, w.grad

            for got, want in zip(round_trip(), custom_ops(round_trip)()):
                assert torch.equal(got, want)
            timed = median_ms({"eager": round_trip, "custom op": custom_ops(round_trip)}, args.reps, device)
            rows.append(
                (
                    "permute+combine fwd+bwd",
                    f"{dname} T={T} D={D} E={E} k={args.topk}",
                    timed["eager"],
                    "custom op",
                    timed["custom op"],
                )
            )
        grads = [torch.randn(n, device=device).to(dtype) for n in (256 * 768, 768, 256 * 256, 256, 256, 256) * 4]
        flat = torch.zeros(sum(t.numel() for t in grads), device=device)
        offsets = [sum(t.numel() for t in grads[:i]) for i in range(len(grads))]
        # one call per tensor: what each call costs beyond its kernel
        per_param = lambda: [ops.flatten_into(flat, [t], [o], accumulate=True) for t, o in zip(grads, offsets)]
        timed = median_ms({"eager": per_param, "custom op": custom_ops(per_param)}, args.reps, device)
        rows.append(
            (
                "flatten_into, one per param",
                f"{dname} {len(grads)} tensors, {flat.numel()} elements",
                timed["eager"],
                "custom op",
                timed["custom op"],
            )
        )
    return rows


def print_op_table(rows: List[Row], ours: str = "compiled", theirs: str = "best torch") -> None:
    print(f"{'op':28s} {'config':44s} {ours:>10s} {theirs:>11s}  {'ratio':>6s}  {theirs} version")
    for op, cfg, ms, name, best_ms in rows:
        print(f"{op:28s} {cfg:44s} {ms:8.2f}ms {best_ms:9.2f}ms  {best_ms / ms:5.2f}x  {name}")


# ---- end-to-end MoE layer ---------------------------------------------------------------------


def layer_step_ms(args, device: str) -> None:
    try:
        from moezero.moe import MoEConfig, MoELayer
        from moezero.parallel import ParallelGroups
    except ImportError as exc:  # the layer lands separately from the kernels
        print(f"\nMoE layer step skipped: {exc}")
        return
    if args.wire_all:  # measure what wiring every compiled op would give (the CUDA ones are not wired yet)
        _library.WIRED = {**_library.WIRED, device: frozenset(_library.OPS)}
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=args.layer_hidden, ffn_hidden_size=args.layer_ffn, num_experts=8, top_k=2)
    layer = MoELayer(cfg, ParallelGroups.single()).to(device)
    x = torch.randn(args.layer_tokens, args.layer_hidden, device=device, requires_grad=True)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y, stats = layer(x)
        (y.float().square().mean() + stats.aux_loss).backward()
        return y.detach(), x.grad

    def with_env(disabled: str):
        def run():
            os.environ[_loader.DISABLE_ENV] = disabled
            return step()

        return run

    runs = {"extension": with_env("0"), "reference": with_env("1")}
    outputs = {label: run() for label, run in runs.items()}
    for got, want in zip(outputs["extension"], outputs["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    timed = median_ms(runs, args.reps, device)
    os.environ.pop(_loader.DISABLE_ENV)
    ext_ms, ref_ms = timed["extension"], timed["reference"]
    print(
        f"\nMoELayer fwd+bwd T={args.layer_tokens} D={args.layer_hidden} F={args.layer_ffn} E=8 k=2 fp32: "
        f"extension {ext_ms:.1f}ms, reference {ref_ms:.1f}ms, ratio {ref_ms / ext_ms:.2f}x (same outputs); "
        f"compiled ops wired: {', '.join(sorted(_library.WIRED.get(device, ()))) or 'none'}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=tuple(DTYPES))
    p.add_argument("--layers", type=int, default=2, help="GPT blocks whose gradients form the bucket")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--layer-tokens", type=int, default=4096)
    p.add_argument("--layer-hidden", type=int, default=512)
    p.add_argument("--layer-ffn", type=int, default=1024)
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--wire-all", action="store_true", help="run the layer with every compiled op wired in")
    p.add_argument("--vocab", type=int, nargs="+", default=[1024, 32000], help="vocabularies of the cross-entropy rows")
    p.add_argument(
        "--only",
        choices=("routing", "bucket", "gelu", "bias_add", "rms_norm", "swiglu", "cross_entropy", "dispatch"),
        help="time one op family only",
    )
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.pop(_loader.DISABLE_ENV, None)
    ext = _loader.load(args.device)
    if ext is None:
        print(f"the compiled extension for {args.device} is not built; nothing to compare", file=sys.stderr)
        return 1
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
    from machine import describe

    print(f"Machine: {describe()}; device {args.device}, threads {torch.get_num_threads()}, median of {args.reps}")
    rows = []
    if args.only in (None, "routing"):
        rows += routing_rows(ext, args, args.device)
    if args.only in (None, "bucket"):
        rows += bucket_rows(ext, args, args.device)
    if args.only in (None, "gelu"):
        rows += gelu_rows(ext, args, args.device)
    if args.only in (None, "bias_add"):
        rows += bias_add_rows(ext, args, args.device)
    if args.only in (None, "rms_norm"):
        rows += rms_norm_rows(ext, args, args.device)
    if args.only in (None, "swiglu"):
        rows += swiglu_rows(ext, args, args.device)
    if args.only in (None, "cross_entropy"):
        rows += cross_entropy_rows(ext, args, args.device)
    if rows:
        print_op_table(rows)
    if args.only in (None, "dispatch"):
        print("\nThe eager path (ops/eager.py) against the same kernels through the torch.library custom ops:")
        print_op_table(dispatch_rows(args, args.device), "eager", "custom op")
    if not args.skip_layer:
        layer_step_ms(args, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
