"""Expert rows padded to size classes (issue 24): a run meets a bounded set of GEMM shapes whatever the routing,
and the outputs and gradients are the unpadded ones.

The shapes are the GEMMs that really ran (aten::mm, addmm and bmm as the dispatcher sees them, which is also
what torch._grouped_mm runs per group on CPUs), in forward and backward.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moezero.moe import MoEConfig
from moezero.moe.experts import GroupedExperts, row_size_class
from moezero.parallel.expert_marker import ExpertShard

GEMMS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
GEMMS_PER_EXPERT = 6  # forward: x @ w1, h @ w2; backward: the data and weight gradient of each


def _experts(dtype, num_experts=4, **kw):
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=24, num_experts=num_experts, **kw)
    experts = GroupedExperts(cfg, ExpertShard(num_experts, 0, 1)).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)  # biases too: a padded row's hidden activation is then not zero
    return experts


def _classes_up_to(rows: int) -> int:
    """How many size classes the rule allows up to `rows`: 0, 8, then four per power of two."""
    return 2 + 4 * max(0, math.ceil(math.log2(rows / 8)))


def test_size_classes_waste_at_most_a_quarter_four_per_octave():
    classes = [row_size_class(n) for n in range(4097)]
    assert classes[0] == 0 and set(classes[1:9]) == {8}
    for n in range(9, 4097):
        assert n <= classes[n] <= 1.25 * n and row_size_class(classes[n]) == classes[n]
        assert classes[n] >= classes[n - 1]
    assert sorted(set(c for c in classes if 16 <= c < 32)) == [16, 20, 24, 28]
    assert len(set(classes)) <= _classes_up_to(4096)


def _skewed_counts(gen, num_experts):
    """A step's rows per expert: 32-700 tokens (x top-2), spread by a skewed, per-step random popularity."""
    tokens = int(torch.randint(32, 700, (), generator=gen)) * 2
    popularity = torch.distributions.Dirichlet(torch.full((num_experts,), 0.3)).sample()
    return (
        torch.multinomial(popularity, tokens, replacement=True, generator=gen).bincount(minlength=num_experts).tolist()
    )


def _gemm_shapes_of_run(pad: bool, grouped: bool, steps: int = 100):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    experts = _experts(torch.float32, activation="swiglu", grouped_gemm=grouped, pad_expert_rows=pad)
    max_rows = 0
    with _GemmShapes() as recorded:
        for _ in range(steps):
            counts = _skewed_counts(gen, 4)
            max_rows = max(max_rows, *counts)
            x = torch.randn(sum(counts), 16, requires_grad=True)
            experts(x, counts).square().sum().backward()
    return recorded.shapes, max_rows


class _GemmShapes(TorchDispatchMode):
    """The (a, b) shapes of every GEMM that runs, forward and backward (the dispatcher sees what
    torch._grouped_mm runs per group on CPUs too)."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in GEMMS:
            a, b = args[-2:] if func.overloadpacket is torch.ops.aten.addmm else args[:2]
            self.shapes.add((tuple(a.shape), tuple(b.shape)))
        elif func.overloadpacket is torch.ops.aten._grouped_mm:
            self.shapes |= _group_shapes(args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None))
        return func(*args, **kwargs)


def _group_shapes(a, b, offs):
    """The per-group GEMMs of torch._grouped_mm (a CPU runs one mm each): rows of `a` split by `offs` against
    the stacked `b` (forward, data gradient), or the shared dimension split (weight gradient)."""
    ends = offs.tolist()
    sizes = [end - start for start, end in zip([0] + ends[:-1], ends)]
    if a.dim() == 2 and b.dim() == 3:
        return {((n, a.shape[1]), tuple(b.shape[1:])) for n in sizes}
    assert a.dim() == 2 and b.dim() == 2, (a.shape, b.shape)
    return {((a.shape[0], n), (n, b.shape[1])) for n in sizes}


@pytest.mark.parametrize("grouped", [True, False])
def test_gemm_shapes_stay_within_the_size_classes_over_100_skewed_steps(grouped):
    bound_of = lambda rows: GEMMS_PER_EXPERT * _classes_up_to(rows)  # noqa: E731
    padded, max_rows = _gemm_shapes_of_run(pad=True, grouped=grouped)
    assert padded and len(padded) <= bound_of(max_rows), (len(padded), max_rows)
    unpadded, max_rows = _gemm_shapes_of_run(pad=False, grouped=grouped)
    assert len(unpadded) > 3 * bound_of(max_rows), (len(unpadded), max_rows)  # the bound is not vacuous


COUNTS = [5, 0, 17, 33, 8, 40]  # the class of 1-8, an expert with no rows, padded ones, exact classes


def _outputs_and_grads(experts, x, pad):
    experts.pad_rows = pad
    x = x.detach().clone().requires_grad_(True)
    y = experts(x, COUNTS)
    params = [p for p in (experts.w1, experts.w2, experts.b1, experts.b2) if p is not None]
    grads = torch.autograd.grad(
        y, [x] + params, torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    )
    return [y] + list(grads)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grouped", [True, False])
def test_padded_outputs_and_gradients_equal_unpadded(dtype, tol, activation, bias, grouped):
    torch.manual_seed(2)
    experts = _experts(dtype, num_experts=len(COUNTS), activation=activation, bias=bias, grouped_gemm=grouped)
    x = torch.randn(sum(COUNTS), 16, dtype=dtype)
    padded, unpadded = _outputs_and_grads(experts, x, True), _outputs_and_grads(experts, x, False)
    names = ["y", "x", "w1", "w2", "b1", "b2"] if bias else ["y", "x", "w1", "w2"]
    for name, a, b in zip(names, padded, unpadded):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    assert padded[2][1].abs().max() == 0  # the expert with no rows gets an exactly zero w1 gradient
