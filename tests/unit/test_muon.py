"""moezero.zero.Muon alone (a single process), against megatron-core's QKV split and torch.optim.Muon.

The ZeRO runs are tested against a float64 transcription of Megatron's Muon in tests/distributed/test_zero_muon.py;
here: (1) the fused QKV weight is orthogonalised per query, key and value block as megatron-core's
TensorParallelMuon.orthogonalize does on its own layout (rows interleaved per query group), transcribed and run on
the weight permuted into that layout; (2) with torch's coefficients ("simple"), its lr adjustment ("original" is
shape_scaling), Nesterov and weight decay, one step equals torch.optim.Muon's up to its bf16 iterations;
(3) muon_param_groups gives Adam what megatron-core gives Adam."""

import torch
import torch.nn.functional as F
from torch import nn

from moezero.zero import Muon, muon_param_groups

HEADS, GROUPS, HEAD_DIM, HIDDEN = 4, 2, 3, 10


class Attention(nn.Module):  # moezero's layout: rows [all queries; all keys; all values]
    def __init__(self):
        super().__init__()
        self.heads, self.groups, self.head_dim = HEADS, GROUPS, HEAD_DIM
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * GROUPS) * HEAD_DIM, bias=False, dtype=torch.float64)


def _to_megatron_rows():
    """Row permutation: Megatron's interleaved [q_g, k_g, v_g per query group] from moezero's blocks."""
    per_q, q_rows = HEADS // GROUPS * HEAD_DIM, HEADS * HEAD_DIM
    order = []
    for g in range(GROUPS):
        order += list(range(g * per_q, (g + 1) * per_q))
        order += list(range(q_rows + g * HEAD_DIM, q_rows + (g + 1) * HEAD_DIM))
        order += list(range(q_rows + GROUPS * HEAD_DIM + g * HEAD_DIM, q_rows + GROUPS * HEAD_DIM + (g + 1) * HEAD_DIM))
    return torch.tensor(order)


def _ns(x):  # emerging_optimizers' quintic newton_schulz, float64
    coeffs = [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ]
    t = x.size(0) > x.size(1)
    X = F.normalize(x.T if t else x, p=2, dim=(-2, -1), eps=1e-7)
    for a, b, c in coeffs:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if t else X


def _megatron_split_orthogonalize(grad):
    """TensorParallelMuon.orthogonalize with split_qkv, spectral scale (megatron-core 0.16.1's muon.py)."""
    split_shapes = [HEADS // GROUPS * HEAD_DIM, HEAD_DIM, HEAD_DIM]
    shape = grad.shape
    parts = torch.split(grad.view(GROUPS, sum(split_shapes), -1), split_shapes, dim=1)
    parts = [g.reshape(-1, shape[-1]) for g in parts]
    parts = [(_ns(g) * max(g.shape) ** 0.5).view(GROUPS, -1, shape[-1]) for g in parts]
    return torch.cat(parts, dim=1).view(shape)


def test_the_fused_qkv_weight_is_split_as_megatron_splits_it():
    module = Attention()
    groups = muon_param_groups(module, 0.0)
    assert groups[0]["muon_split_rows"] == (HEADS * HEAD_DIM, GROUPS * HEAD_DIM, GROUPS * HEAD_DIM)
    before = module.qkv.weight.detach().clone()
    grad = torch.randn(before.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    module.qkv.weight.grad = grad.clone()
    Muon(groups, lr=1.0, momentum=0.0, fp32_matmul_prec="high").step()
    order = _to_megatron_rows()
    theirs = torch.empty_like(grad)
    theirs[order] = _megatron_split_orthogonalize(grad[order])
    torch.testing.assert_close(before - module.qkv.weight.detach(), theirs, rtol=1e-10, atol=1e-12)
    whole = Attention()  # --muon-no-split-qkv: one matrix, which differs
    whole.qkv.weight.data.copy_(before)
    whole.qkv.weight.grad = grad.clone()
    Muon(muon_param_groups(whole, 0.0, split_qkv=False), lr=1.0, momentum=0.0, fp32_matmul_prec="high").step()
    assert not torch.allclose(whole.qkv.weight, module.qkv.weight)


def test_one_step_equals_torchs_muon_up_to_its_bf16_iterations():
    torch.manual_seed(0)
    ours, theirs = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
    theirs.load_state_dict(ours.state_dict())
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True)
    opt = Muon(muon_param_groups(ours, 0.1), scale_mode="shape_scaling", coefficient_type="simple", **hyper)
    ref = torch.optim.Muon(theirs.parameters(), adjust_lr_fn="original", **hyper)
    start = ours.weight.detach().clone()
    for _ in range(2):
        grad = torch.randn(24, 16)
        ours.weight.grad, theirs.weight.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    moved, moved_ref = ours.weight.detach() - start, theirs.weight.detach() - start
    assert (moved - moved_ref).norm() < 0.05 * moved_ref.norm(), ((moved - moved_ref).norm(), moved_ref.norm())
    assert (moved - moved_ref).norm() > 0  # different bf16 roundings (1.5% here; 25% without nesterov)


def test_adam_gets_what_megatron_gives_adam():
    model = nn.ModuleDict(
        {"embedding": nn.Embedding(8, 4), "proj": nn.Linear(4, 4), "norm": nn.LayerNorm(4), "output": nn.Linear(4, 8)}
    )
    model.output = model["output"]
    muon = {id(p) for g in muon_param_groups(model, 0.1) if g["muon"] for p in g["params"]}
    assert muon == {id(model["proj"].weight)}


def test_the_tp_mode_flag_reaches_muon_and_a_bad_mode_is_one_line():
    """--muon-tp-mode is Muon's tp_mode (its runs at tp 2: tests/distributed/test_tp_model_exactness.py)."""
    import pytest

    from moezero.training.builders import optimizer_class
    from tests.integration.pretrain_utils import TINY, configs

    cls, kwargs = optimizer_class(configs(TINY + ["--optimizer", "muon", "--muon-tp-mode", "duplicated"]))
    assert cls is Muon and kwargs["tp_mode"] == "duplicated"
    with pytest.raises(
        ValueError, match="^--muon-tp-mode 'rowwise': choose one of blockwise, duplicated, distributed$"
    ):
        Muon(muon_param_groups(Attention(), 0.0), tp_mode="rowwise")
