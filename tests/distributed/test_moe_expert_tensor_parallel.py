"""Expert tensor parallelism (ETP) in the MoE layer on one 2-rank gloo world, float64: etp 2 at ep 1, against one
process's layer on every rank's tokens. The layer alone (GLU and not, with biases; each rank its own tokens, and the
same tokens on both ranks), then a small model under ZeroOptimizer (stages 1 and 3, 3 steps, clipping) against one
process under torch's AdamW: the losses, the gradient norm and the consolidated weights and AdamW state."""

import dataclasses
import datetime
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moezero.keyed_random import init_keyed_
from moezero.moe import MoEConfig, MoELayer
from moezero.parallel import ParallelGroups, expert_shard_of
from moezero.parallel.groups import rank_layout
from moezero.parallel.tensor_marker import mark_tp_partial, tensor_shard_of
from tests.dist_utils import run_distributed

ETP = 2
DT = torch.float64
H, FFN, E, T = 8, 6, 4, 12  # T tokens per rank
ACTIVATIONS = ("swiglu", "gelu")
ADAMW = dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))


def _config(activation, **kw):
    return MoEConfig(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, top_k=2, activation=activation, bias=True, **kw)


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _local(p, whole):
    """This rank's part of one process's tensor `whole`: its ep rank's experts, their etp slice; a dense one whole."""
    experts, shard = expert_shard_of(p), tensor_shard_of(p)
    if experts is not None:
        whole = whole.narrow(0, experts.first_global_expert, experts.num_local_experts)
    return whole if shard is None else shard.local_of(whole)


def _max_diff(a, b):
    return float((a - b).detach().abs().max())


# ---- the layer: forward and backward -----------------------------------------------------------------------------


def _layer_case(groups, activation, same_tokens):
    """Max |diff| of (output, input grad, expert grads, router grad summed over the ranks) against one process on
    every rank's tokens, and of the initial expert slices (keyed init: the slices of one process's experts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, layer = MoELayer(_config(activation)).to(DT), MoELayer(_config(activation), groups).to(DT)
    ref_params, params = dict(reference.named_parameters()), dict(layer.named_parameters())
    diffs = {"init": max(_max_diff(_local(params[n], q), params[n]) for n, q in ref_params.items() if "experts." in n)}
    with torch.no_grad():  # biases away from zero (they start at zero), the same on every rank
        for i, name in enumerate(("experts.b1", "experts.b2")):
            ref_params[name].copy_(_randn(40 + i, *ref_params[name].shape))
            params[name].copy_(_local(params[name], ref_params[name]))
    xs = [_randn(10 + (0 if same_tokens else r), T, H) for r in range(world)]
    grads = [_randn(20 + r, T, H) for r in range(world)]
    x_all = torch.cat(xs).requires_grad_(True)
    y_all, _ = reference(x_all)
    y_all.backward(torch.cat(grads))
    x = xs[rank].clone().requires_grad_(True)
    y, _ = layer(x)
    y.backward(grads[rank])
    mine = slice(rank * T, (rank + 1) * T)
    diffs["y"] = _max_diff(y, y_all[mine])
    diffs["x.grad"] = _max_diff(x.grad, x_all.grad[mine])
    for name, q in ref_params.items():
        p = params[name]
        grad = p.grad.clone()
        if expert_shard_of(p) is None:  # replicated (the router): each rank's part of the gradient
            dist.all_reduce(grad)
        diffs[f"{name}.grad"] = _max_diff(grad, _local(p, q.grad))
    return diffs


def _layer_cases():
    groups = dataclasses.replace(ParallelGroups.single(), etp=dist.new_group(list(range(ETP))))
    cases = {
        (activation, same_tokens): _layer_case(groups, activation, same_tokens)
        for activation in ACTIVATIONS
        for same_tokens in (False, True)
    }
    return cases, _refusal(groups)


def _refusal(groups):
    try:
        MoELayer(dataclasses.replace(_config("gelu"), ffn_hidden_size=5), groups)
    except ValueError as error:
        return str(error)
    return None


def test_moe_layer_at_etp_2_matches_one_process():
    """Rows all-gathered over etp with uneven counts, each rank's ffn slice (GLU gate and up halves split
    separately), outputs reduce-scattered: the output, the input's gradient and every weight's gradient equal one
    process's on all ranks' tokens. An etp that does not divide the experts' widths is refused in one line."""
    for cases, refusal in run_distributed(_layer_cases, ETP):
        for case, diffs in cases.items():
            assert max(diffs.values()) < 1e-12, (case, diffs)
        assert refusal == "expert tensor parallel size 2 must divide the expert ffn size (5) and the hidden size (8)"


def _layer_at_ep_2_etp_2():
    """World 4: ep groups {0,1} {2,3} (rank_layout's), etp groups {0,2} {1,3}, each rank its own tokens."""
    rank = dist.get_rank()
    ep = etp = None
    for members in ((0, 1), (2, 3)):
        group = dist.new_group(list(members))
        ep = group if rank in members else ep
    for members in ((0, 2), (1, 3)):
        group = dist.new_group(list(members))
        etp = group if rank in members else etp
    groups = ParallelGroups(rank_layout(4, 2), rank, ep=ep, etp=etp)
    return _layer_case(groups, "swiglu", same_tokens=False)


def test_moe_layer_at_ep_2_etp_2_matches_one_process():
    """The all-to-all over ep, then the rows gathered over etp and sorted by local expert across (etp rank,
    source) chunks, and back: one process's output and gradients on all 4 ranks' tokens."""
    for diffs in run_distributed(_layer_at_ep_2_etp_2, 4):
        assert max(diffs.values()) < 1e-12, diffs


# ---- ZeroOptimizer over etp shards, dp 2 -------------------------------------------------------------------------

ZERO_STEPS = 3


class _EtpNet(nn.Module):
    def __init__(self, groups, activation):
        super().__init__()
        self.inp = nn.Linear(H, H, dtype=DT)
        init_keyed_(self.inp, 3, lambda name, p: 0.3, prefix="inp.")
        self.moe = MoELayer(_config(activation, aux_loss_coeff=0.05, z_loss_coeff=1e-3), groups, 1).to(DT)

    def forward(self, x, target):
        h = torch.tanh(self.inp(x))
        y, stats = self.moe(h)
        return (y + h - target).square().mean() + stats.aux_loss + stats.z_loss


def _batch(step, index):
    return _randn(100 * step + index, T, H), _randn(100 * step + 50 + index, T, H)


def _zero_groups(layout, timeout=None):
    """ "dp": dp 2, each rank its own micro-batch, the experts at etp 2 (edp of one). "tp": tp 2 = etp 2, dp 1, each
    rank its share of one micro-batch (as under sequence parallelism: its dense params' gradients are partial over
    tp), the tp harness's groups (test_tp_regions.py)."""
    rank, world = dist.get_rank(), list(range(ETP))
    if layout == "tp":
        return dataclasses.replace(ParallelGroups.single(), tp=dist.new_group(world), etp=dist.new_group(world))
    new = functools.partial(dist.new_group, world, timeout=timeout)
    return ParallelGroups(
        rank_layout(ETP, 1),
        rank,
        dp=new(),
        control=new(),
        etp=new(),
        timeout=timeout,
        _lazy={"dp": new(), "edp": None},  # stage 3's gathers: the experts' over a group of one
    )


def _zero_run(stage, activation, layout):
    """The model under ZeroOptimizer on `layout`'s groups (_zero_groups), rank r reading micro-batch r, against
    one process on both micro-batches: max |diff| of the losses and norms per step, then of the consolidated
    weights and AdamW state."""
    from moezero.zero import ZeroOptimizer, consolidate

    rank = dist.get_rank()
    groups = _zero_groups(layout)
    reference, model = _EtpNet(ParallelGroups.single(), activation), _EtpNet(groups, activation)
    share = ETP if layout == "tp" else 1  # at tp 2 each rank's loss is its share of the one micro-batch's
    for p in model.parameters() if layout == "tp" else ():
        if expert_shard_of(p) is None:
            mark_tp_partial(p)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, clip_grad=1.0, **ADAMW)
    diffs = {"loss": 0.0, "norm": 0.0}
    for step in range(ZERO_STEPS):
        ref_loss = sum(reference(*_batch(step, r)) for r in range(ETP)) / ETP
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(*_batch(step, rank)) / share
        loss.backward()
        opt.step()
        opt.zero_grad()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        diffs["loss"] = max(diffs["loss"], abs(float(summed) * share / ETP - float(ref_loss.detach())))
        diffs["norm"] = max(diffs["norm"], abs(opt.last_grad_norm - ref_norm) / ref_norm)
    with opt.modify_model():  # re-adopted from every rank's state: the slices and their state where they were
        pass
    shards = [None] * ETP
    dist.all_gather_object(shards, opt.state_dict())
    full = consolidate(shards)
    for name, q in reference.named_parameters():
        diffs[name] = _max_diff(full["params"][name], q.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            diffs[f"{name} {key}"] = _max_diff(full["state"][name][key], ref_opt.state[q][key])
    return diffs


def _zero_runs(layout):
    return {(stage, activation): _zero_run(stage, activation, layout) for stage in (1, 3) for activation in ACTIVATIONS}


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_zero_over_etp_shards_matches_one_process(layout):
    """The experts' etp slices are ZeRO params at global coordinates: 3 steps with clipping at 1.0 give one
    process's losses and gradient norm, and the consolidated weights and AdamW state are one process's, at stages 1
    and 3. The norm needs no sum of its own over etp: it sums every rank of the control group and then of tp,
    which covers every etp rank ("dp": etp inside dp; "tp": etp = tp), and each slice's elements are owned once."""
    for per_rank in run_distributed(_zero_runs, ETP, layout):
        for case, diffs in per_rank.items():
            assert max(diffs.values()) < 1e-12, (case, diffs)


# ---- ranks that disagree -----------------------------------------------------------------------------------------


def _block_order_disagreements():
    """test_rank_disagreement's MoE tower (3 MoE blocks, ep 1) at etp 2 on the "dp" groups, its blocks run in a
    different order on each rank, at stages 2 and 3: what each rank raised."""
    from moezero.parallel.agreement import RanksDisagree
    from moezero.zero import ZeroOptimizer
    from tests.distributed.test_rank_disagreement import SCENARIOS, _MoETower

    out = {}
    for stage in (2, 3):
        groups = _zero_groups("dp", timeout=datetime.timedelta(seconds=20))
        model = _MoETower(groups, "aux_loss")
        opt = ZeroOptimizer(model, torch.optim.SGD, groups, stage=stage, lr=0.1)
        try:
            SCENARIOS["block order"][0](model, opt, dist.get_rank())
            out[stage] = "no error"
        except RanksDisagree as exc:
            out[stage] = str(exc)
    return out


def test_etp_exchanges_carry_records_so_ranks_in_different_layers_raise():
    """The etp count exchange carries the layer's agreement record (at ep 1 the only exchange the layer makes):
    ranks whose exchanges would pair one layer's rows with another's all raise RanksDisagree naming the layers."""
    for out in run_distributed(_block_order_disagreements, ETP, isolated=True, timeout=200):
        for stage, message in out.items():
            assert message.startswith("the ranks are not doing the same thing"), (stage, message)
        assert "exchanges of 'blocks." in out[2], out
