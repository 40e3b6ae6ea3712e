"""Megatron's Muon under ZeRO (moezero.zero.muon), 2 gloo ranks, every stage, ep 1 and 2.

The oracle is a single-process float64 transcription of megatron-core 0.16.1's Muon (get_megatron_muon_optimizer:
TensorParallelMuon over emerging_optimizers' OrthogonalizedOptimizer, newton_schulz and get_muon_scale_factor),
written here from their source and independent of the package: whole params, routed experts one (out, in) matrix
each as Megatron's per-expert weights, torch's AdamW for the params Megatron gives Adam (embeddings, output layer,
biases, norms)."""

import pytest
import torch
import torch.nn.functional as F

from moezero.parallel import ParallelGroups, is_expert_parallel
from moezero.zero import ZeroOptimizer, consolidate
from moezero.zero.muon import Muon, muon_param_groups
from tests.dist_utils import run_distributed
from tests.zero_model import ZeroTestModel
from tests.zero_reference import ZERO_STAGES, assert_params_match, reference_run, train_step

STEPS = 3
LR, WD, MOMENTUM = 0.05, 0.1, 0.9
QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
SETTINGS = [  # (nesterov, scale_mode, extra_scale_factor)
    (False, "spectral", 1.0),
    (True, "shape_scaling", 0.5),
    (True, "unit_rms_norm", 2.0),
]


def _megatron_newton_schulz(x):
    """emerging_optimizers' newton_schulz (quintic, 5 steps), in float64."""
    transpose = x.size(0) > x.size(1)
    X = x.T if transpose else x
    X = F.normalize(X, p=2, dim=(-2, -1), eps=1e-7)
    for a, b, c in QUINTIC:
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if transpose else X


def _megatron_scale(out, inp, mode):
    return {"spectral": max(out, inp) ** 0.5, "shape_scaling": max(1, out / inp) ** 0.5}.get(mode, (out / inp) ** 0.5)


class MegatronMuonReference:
    """Whole-param Muon as megatron-core's, with torch's AdamW for the others (its ChainedOptimizer)."""

    def __init__(self, model, nesterov, scale_mode, extra):
        self.nesterov, self.scale_mode, self.extra = nesterov, scale_mode, extra
        self.muon, adam = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            two_d = p.ndim - (1 if is_expert_parallel(p) else 0) == 2
            (self.muon if two_d and "embed" not in name else adam).append((name, p))
        decay = [p for n, p in adam if p.ndim >= 2 and not n.endswith("bias")]
        no_decay = [p for n, p in adam if not (p.ndim >= 2 and not n.endswith("bias"))]
        groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=LR)
        self.buffers = {}

    @torch.no_grad()
    def step(self):
        self.adam.step()
        for name, p in self.muon:
            if p.grad is None:
                continue
            p.add_(p, alpha=-WD * LR)
            buf = self.buffers.setdefault(name, torch.zeros_like(p))
            buf.lerp_(p.grad, 1 - MOMENTUM)
            update = p.grad.lerp(buf, MOMENTUM) if self.nesterov else buf
            if is_expert_parallel(p):  # (experts, in, out): each expert's (out, in) weight
                orth = torch.stack([self._scaled(m.T).T for m in update])
            else:
                orth = self._scaled(update)
            p.add_(orth, alpha=-LR)

    def _scaled(self, m):
        return _megatron_newton_schulz(m) * _megatron_scale(m.size(0), m.size(1), self.scale_mode) * self.extra

    def zero_grad(self):
        self.adam.zero_grad()
        for _, p in self.muon:
            p.grad = None


def _reference(setting):
    return [
        h["params"]
        for h in reference_run(
            "adamw", 2, 1, STEPS, make_opt=lambda model: MegatronMuonReference(model, *setting), model_kwargs={}
        )
    ]


def _zero_muon(model, groups, stage, setting):
    nesterov, scale_mode, extra = setting
    return ZeroOptimizer(
        model,
        Muon,
        groups,
        stage=stage,
        bucket_size=64,
        param_groups=muon_param_groups(model, WD),
        lr=LR,
        momentum=MOMENTUM,
        nesterov=nesterov,
        scale_mode=scale_mode,
        extra_scale_factor=extra,
        coefficient_type="quintic",
        fp32_matmul_prec="high",
    )


def _matches_reference(stage, references):
    """Every step equals the reference; after step 1 the run goes on in a fresh optimizer that loaded the state
    (ep 1: this rank's shard, same stage; ep 2: the consolidated state, at the next stage)."""
    for ep in (1, 2):
        for setting, expected in zip(SETTINGS, references):
            groups = ParallelGroups.build(expert_parallel_size=ep)
            model = ZeroTestModel(groups).double()
            opt = _zero_muon(model, groups, stage, setting)
            for step in range(STEPS):
                if step == 2:
                    model, opt = _resumed(opt, groups, stage, setting, consolidated=ep == 2)
                train_step(model, opt, step, 1, use_no_sync=False)
                opt.step()
                opt.zero_grad()
                with opt.full_parameters():
                    assert_params_match(model, expected[step], rtol=1e-10, atol=1e-12)
            groups.destroy()
    return True


def _resumed(opt, groups, stage, setting, consolidated):
    state = opt.state_dict()
    if consolidated:
        shards = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shards, state)
        state, stage = consolidate(shards), (stage + 1) % 4
    model = ZeroTestModel(groups, seed=9).double()  # other weights: the load must bring them
    resumed = _zero_muon(model, groups, stage, setting)
    resumed.load_state_dict(state)
    return model, resumed


@pytest.fixture(scope="module")
def references():
    return [_reference(setting) for setting in SETTINGS]


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_muon_under_zero_equals_megatrons_muon(stage, references):
    """Stages 0-3, ep 1 and 2, nesterov or not, each scale mode: params equal the float64 reference every step, also
    after a resume from the saved state (the momentum buffers, the Adam moments, the masters)."""
    assert all(run_distributed(_matches_reference, 2, stage, references))


def test_the_reference_moves_the_matrices_as_muon_does():
    """The oracle is not vacuous: its orthogonalised update has singular values near 1 (quintic's band)."""
    g = torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(_megatron_newton_schulz(g))
    assert 0.6 < s.min() and s.max() < 1.3
