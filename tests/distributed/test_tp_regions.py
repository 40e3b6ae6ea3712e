"""Tensor-parallel regions, column/row-parallel linears and the vocab-parallel embedding and loss on one 2-rank
gloo world, float64, against one process's math (the same ops on the global tensors), torch's DTensor tensor
parallelism and megatron-core's layers."""

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moezero.parallel import tp_regions
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.parallel import tp_linear, vocab_parallel
from moezero.parallel.vocab_parallel import vocab_parallel_cross_entropy
from tests.dist_utils import run_distributed

TP = 2
DT = torch.float64
ColumnParallelLinear = functools.partial(tp_linear.ColumnParallelLinear, dtype=DT)
RowParallelLinear = functools.partial(tp_linear.RowParallelLinear, dtype=DT)
VocabParallelEmbedding = functools.partial(vocab_parallel.VocabParallelEmbedding, dtype=DT)


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _tp_group():
    return dist.new_group([0, 1])


# ---- regions ---------------------------------------------------------------------------------------------------


def _run_region(fn, x, grad_out):
    """fn(x) and x's gradient for the upstream gradient `grad_out`; checks `x` is left as it was."""
    x = x.clone().requires_grad_(True)
    before = x.detach().clone()
    y = fn(x)
    y.backward(grad_out)
    assert torch.equal(x.detach(), before), "a region wrote into its input"
    return y.detach(), x.grad


def _check_regions():
    tp, rank = _tp_group(), dist.get_rank()
    shape = (2, 4, 6)  # (B, S, D): every dim splits over 2
    per_rank = [_randn(r, *shape) for r in range(TP)]  # each rank's own tensor, known to every rank
    grads = [_randn(10 + r, *shape) for r in range(TP)]
    mine, grad = per_rank[rank], grads[rank]

    y, dx = _run_region(lambda x: tp_regions.copy_to_tp(x, tp), per_rank[0], grad)
    _close(y, per_rank[0], "copy_to_tp forward")
    _close(dx, grads[0] + grads[1], "copy_to_tp backward")

    y, dx = _run_region(lambda x: tp_regions.reduce_from_tp(x, tp), mine, grads[0])
    _close(y, per_rank[0] + per_rank[1], "reduce_from_tp forward")
    _close(dx, grads[0], "reduce_from_tp backward")

    for dim in (0, 1, -1):
        half = [g.chunk(TP, dim)[rank] for g in grads]  # upstream gradients shaped as a shard
        y, dx = _run_region(lambda x: tp_regions.scatter_to_sp(x, tp, dim), per_rank[0], half[rank])
        _close(y, per_rank[0].chunk(TP, dim)[rank], f"scatter_to_sp({dim}) forward")
        _close(dx, torch.cat([g.chunk(TP, dim)[r] for r, g in enumerate(grads)], dim), f"scatter_to_sp({dim}) bwd")

        shard = mine.chunk(TP, dim)[rank]
        y, dx = _run_region(lambda x: tp_regions.gather_from_sp(x, tp, dim), shard, grad)
        _close(y, torch.cat([p.chunk(TP, dim)[r] for r, p in enumerate(per_rank)], dim), f"gather_from_sp({dim})")
        _close(dx, (grads[0] + grads[1]).chunk(TP, dim)[rank], f"gather_from_sp({dim}) backward")

        y, dx = _run_region(lambda x: tp_regions.reduce_scatter_to_sp(x, tp, dim), mine, half[rank])
        _close(y, (per_rank[0] + per_rank[1]).chunk(TP, dim)[rank], f"reduce_scatter_to_sp({dim}) forward")
        _close(dx, torch.cat([g.chunk(TP, dim)[r] for r, g in enumerate(grads)], dim), f"reduce_scatter_to_sp({dim})")

    # a gathered last dim, of a non-contiguous input (a transposed view)
    whole_grad = _randn(20, 2, 6, 4 * TP)
    y, dx = _run_region(lambda x: tp_regions.gather_last_dim(x.transpose(1, 2), tp), mine, whole_grad)
    _close(y, torch.cat([p.transpose(1, 2) for p in per_rank], -1), "gather_last_dim forward")
    _close(dx.transpose(1, 2), whole_grad.chunk(TP, -1)[rank], "gather_last_dim backward")

    for region in (tp_regions.copy_to_tp, tp_regions.reduce_from_tp, tp_regions.gather_last_dim):
        assert region(mine, None) is mine
    for region in (tp_regions.scatter_to_sp, tp_regions.gather_from_sp, tp_regions.reduce_scatter_to_sp):
        assert region(mine, None, 1) is mine
    try:
        tp_regions.gather_from_sp(_randn(0, 2, 3, 4), tp, 1)  # gathers fine: 3 rows each
        tp_regions.reduce_scatter_to_sp(_randn(0, 2, 3, 4), tp, 1)
    except ValueError as e:
        assert "does not split over a tensor-parallel group of 2" in str(e)
    else:
        raise AssertionError("a reduce-scatter of 3 rows over 2 ranks was not refused")
    return True


def test_regions_forward_and_backward_against_one_process():
    assert all(run_distributed(_check_regions, TP))


# ---- column- and row-parallel linears --------------------------------------------------------------------------

B, S, H, FFN = 2, 4, 6, 8


def _glu(h):
    gate, up = h.chunk(2, -1)
    return F.silu(gate) * up


def _mlp_reference(glu, bias, seed):
    """One process: the global MLP's output, the upstream gradient and every gradient, float64."""
    fc1_out = 2 * FFN if glu else FFN
    w = {
        "x": _randn(seed, B, S, H),
        "w1": _randn(seed + 1, fc1_out, H),
        "w2": _randn(seed + 2, H, FFN),
        "b1": _randn(seed + 3, fc1_out) if bias else None,
        "b2": _randn(seed + 4, H) if bias else None,
        "g": _randn(seed + 5, B, S, H),
    }
    leaves = {k: v.clone().requires_grad_(True) for k, v in w.items() if v is not None and k != "g"}
    act = _glu if glu else torch.relu
    y = F.linear(act(F.linear(leaves["x"], leaves["w1"], leaves.get("b1"))), leaves["w2"], leaves.get("b2"))
    y.backward(w["g"])
    return w, y.detach(), {k: v.grad for k, v in leaves.items()}


def _check_mlp(glu, bias, sequence_parallel):
    tp, rank = _tp_group(), dist.get_rank()
    w, y_ref, grads = _mlp_reference(glu, bias, seed=100)
    fc1 = ColumnParallelLinear(
        H, w["w1"].shape[0], tp, bias=bias, sequence_parallel=sequence_parallel, parts=(FFN, FFN) if glu else None
    ).copy_from_global_(w["w1"], w["b1"])
    fc2 = RowParallelLinear(FFN, H, tp, bias=bias, sequence_parallel=sequence_parallel).copy_from_global_(
        w["w2"], w["b2"]
    )
    assert fc1.weight.dtype == DT and fc1.weight.shape == (w["w1"].shape[0] // TP, H)
    shard = (lambda t: t.chunk(TP, 1)[rank]) if sequence_parallel else (lambda t: t)
    x = shard(w["x"]).clone().requires_grad_(True)
    y = fc2((_glu if glu else torch.relu)(fc1(x)))
    y.backward(shard(w["g"]))
    case = f"glu={glu} bias={bias} sp={sequence_parallel}"
    _close(y, shard(y_ref), f"{case}: output")
    _close(x.grad, shard(grads["x"]), f"{case}: input gradient")
    _close(fc1.weight.grad, tensor_shard_of(fc1.weight).local_of(grads["w1"]), f"{case}: fc1 weight gradient")
    _close(fc2.weight.grad, tensor_shard_of(fc2.weight).local_of(grads["w2"]), f"{case}: fc2 weight gradient")
    if bias:
        _close(fc1.bias.grad, tensor_shard_of(fc1.bias).local_of(grads["b1"]), f"{case}: fc1 bias gradient")
        # the row-parallel bias is whole on every rank: its gradient is whole too without SP, and partial (the
        # rank's sequence shard) under SP, summing to the one-process gradient over the group
        summed = fc2.bias.grad.clone()
        dist.all_reduce(summed, group=tp)
        _close(summed if sequence_parallel else fc2.bias.grad, grads["b2"], f"{case}: fc2 bias gradient")
    return True


def _check_gathered_ends():
    """gather_output (fused parts back in the global order) and a row-parallel layer slicing a whole input."""
    tp = _tp_group()
    w, _, _ = _mlp_reference(glu=True, bias=True, seed=200)
    fc1 = ColumnParallelLinear(H, 2 * FFN, tp, gather_output=True, parts=(FFN, FFN)).copy_from_global_(w["w1"], w["b1"])
    x = w["x"].clone().requires_grad_(True)
    h = fc1(x)
    h_ref_x = w["x"].clone().requires_grad_(True)
    h_ref = F.linear(h_ref_x, w["w1"], w["b1"])
    _close(h, h_ref, "gathered fused output")
    g = _randn(201, B, S, 2 * FFN)
    h.backward(g)
    h_ref.backward(g)
    _close(x.grad, h_ref_x.grad, "gathered fused output: input gradient")
    fc2 = RowParallelLinear(2 * FFN, H, tp, input_is_parallel=False).copy_from_global_(_randn(202, H, 2 * FFN), w["b2"])
    _close(fc2(h.detach()), F.linear(h_ref.detach(), _randn(202, H, 2 * FFN), w["b2"]), "row-parallel, whole input")
    return True


def _check_linears():
    for glu in (False, True):
        for bias in (False, True):
            for sequence_parallel in (False, True):
                _check_mlp(glu, bias, sequence_parallel)
    return _check_gathered_ends()


def test_column_and_row_parallel_mlp_against_one_process():
    assert all(run_distributed(_check_linears, TP))


def _check_against_dtensor():
    """Our layers against torch's DTensor tensor parallelism (ColwiseParallel / RowwiseParallel on an
    nn.Linear pair), without and with sequence parallelism on dim 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (TP,))
    tp = mesh.get_group()
    w, _, _ = _mlp_reference(glu=False, bias=True, seed=300)
    for sequence_parallel in (False, True):
        theirs = nn.Sequential(nn.Linear(H, FFN, dtype=DT), nn.ReLU(), nn.Linear(FFN, H, dtype=DT))
        with torch.no_grad():
            for p, v in zip(theirs.parameters(), (w["w1"], w["b1"], w["w2"], w["b2"])):
                p.copy_(v)
        seq = Shard(1) if sequence_parallel else None
        plan = {
            "0": ColwiseParallel(input_layouts=seq) if seq else ColwiseParallel(),
            "2": RowwiseParallel(output_layouts=seq) if seq else RowwiseParallel(),
        }
        parallelize_module(theirs, mesh, plan)
        fc1 = ColumnParallelLinear(H, FFN, tp, sequence_parallel=sequence_parallel).copy_from_global_(w["w1"], w["b1"])
        fc2 = RowParallelLinear(FFN, H, tp, sequence_parallel=sequence_parallel).copy_from_global_(w["w2"], w["b2"])
        x = w["x"].chunk(TP, 1)[rank] if sequence_parallel else w["x"]
        g = w["g"].chunk(TP, 1)[rank] if sequence_parallel else w["g"]
        ours_x, their_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y = fc2(torch.relu(fc1(ours_x)))
        y.backward(g)
        y_theirs = theirs(their_x)
        y_theirs.backward(g)
        case = f"DTensor sp={sequence_parallel}"
        _close(y, y_theirs, f"{case}: output")
        _close(ours_x.grad, their_x.grad, f"{case}: input gradient")
        for ours, their in zip(
            (fc1.weight, fc1.bias, fc2.weight), (theirs[0].weight, theirs[0].bias, theirs[2].weight)
        ):
            _close(ours.grad, their.grad.to_local(), f"{case}: sharded gradient")
        their_bias = theirs[2].bias.grad.full_tensor() if sequence_parallel else theirs[2].bias.grad.to_local()
        summed = fc2.bias.grad.clone()
        if sequence_parallel:  # DTensor reduces the replicated bias' partial gradients itself; ours are left partial
            dist.all_reduce(summed, group=tp)
        _close(summed, their_bias, f"{case}: row bias gradient")
    return True


def test_linears_against_dtensor_tensor_parallel():
    assert all(run_distributed(_check_against_dtensor, TP))


# ---- vocabulary-parallel embedding and loss --------------------------------------------------------------------

V = 12


def _check_embedding():
    tp, rank = _tp_group(), dist.get_rank()
    table = _randn(400, V, H)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(401))
    g = _randn(402, B, S, H)
    ref_table = table.clone().requires_grad_(True)
    ref = F.embedding(ids, ref_table)
    ref.backward(g)
    for sequence_parallel in (False, True):
        emb = VocabParallelEmbedding(V, H, tp, sequence_parallel=sequence_parallel).copy_from_global_(table)
        shard = (lambda t: t.chunk(TP, 1)[rank]) if sequence_parallel else (lambda t: t)
        out = emb(ids)
        out.backward(shard(g))
        _close(out, shard(ref.detach()), f"embedding sp={sequence_parallel}")
        _close(emb.weight.grad, ref_table.grad.chunk(TP, 0)[rank], f"embedding sp={sequence_parallel}: gradient")
    return True


def test_vocab_parallel_embedding_against_one_process():
    assert all(run_distributed(_check_embedding, TP))


def _cross_entropy_case(seed, dtype=DT):
    logits = _randn(seed, B, S, V).to(dtype)
    target = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed + 1))
    target[0, 1] = -100  # ignored, as F.cross_entropy's default ignore_index
    return logits, target, _randn(seed + 2, B, S)


def _check_cross_entropy():
    tp, rank = _tp_group(), dist.get_rank()
    logits, target, weights = _cross_entropy_case(500)
    logits[1, 2, 7] += 50.0  # a peak on rank 1's slice: the max is the group's
    for alpha in (0.0, 0.1):
        ref_logits = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(
            ref_logits.flatten(0, 1), target.flatten(), reduction="none", label_smoothing=alpha * V / (V - 1)
        ).view(B, S)
        ref.backward(weights)
        shard = logits.chunk(TP, -1)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(shard, target, tp, label_smoothing=alpha)
        loss.backward(weights)
        _close(loss, ref.detach(), f"cross-entropy, smoothing {alpha}")
        _close(shard.grad, ref_logits.grad.chunk(TP, -1)[rank], f"cross-entropy gradient, smoothing {alpha}")
        assert loss[0, 1] == 0 and not shard.grad[0, 1].any()
    # bf16 logits: the loss in fp32 (as token_cross_entropy), the gradient in the logits' dtype
    low, target, weights = _cross_entropy_case(510, torch.bfloat16)
    shard = low.chunk(TP, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, tp)
    loss.backward(weights.float())
    assert loss.dtype == torch.float32 and shard.grad.dtype == torch.bfloat16
    wide = low.float().requires_grad_(True)
    ref = F.cross_entropy(wide.flatten(0, 1), target.flatten(), reduction="none").view(B, S)
    ref.backward(weights.float())
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shard.grad, wide.grad.chunk(TP, -1)[rank].bfloat16())
    return True


def test_vocab_parallel_cross_entropy_against_torch():
    assert all(run_distributed(_check_cross_entropy, TP))


# ---- megatron-core's tensor_parallel as the oracle -------------------------------------------------------------


def _megatron_config():
    from megatron.core import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=TP, use_cpu_initialization=True, params_dtype=DT, perform_initialization=False
    )


def _check_megatron_layers(tp):
    """megatron-core's ColumnParallelLinear / RowParallelLinear (no SP: its SP path allocates on CUDA) and
    VocabParallelEmbedding with an explicit tp_group, holding the same global weights."""
    from megatron.core import tensor_parallel as mtp

    rank, config = dist.get_rank(), _megatron_config()
    w, _, _ = _mlp_reference(glu=False, bias=True, seed=600)
    kw = dict(config=config, init_method=lambda _: None, bias=True, skip_bias_add=False, tp_group=tp)
    m_fc1 = mtp.ColumnParallelLinear(H, FFN, gather_output=False, **kw)
    m_fc2 = mtp.RowParallelLinear(FFN, H, input_is_parallel=True, **kw)
    fc1 = ColumnParallelLinear(H, FFN, tp).copy_from_global_(w["w1"], w["b1"])
    fc2 = RowParallelLinear(FFN, H, tp).copy_from_global_(w["w2"], w["b2"])
    with torch.no_grad():
        for theirs, ours in ((m_fc1, fc1), (m_fc2, fc2)):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
    x_theirs, x_ours = w["x"].clone().requires_grad_(True), w["x"].clone().requires_grad_(True)
    y_theirs = m_fc2(torch.relu(m_fc1(x_theirs)[0]))[0]
    y_theirs.backward(w["g"])
    y = fc2(torch.relu(fc1(x_ours)))
    y.backward(w["g"])
    _close(y, y_theirs, "megatron-core MLP: output")
    _close(x_ours.grad, x_theirs.grad, "megatron-core MLP: input gradient")
    for theirs, ours in ((m_fc1, fc1), (m_fc2, fc2)):
        _close(ours.weight.grad, theirs.weight.grad, "megatron-core MLP: weight gradient")
        _close(ours.bias.grad, theirs.bias.grad, "megatron-core MLP: bias gradient")

    table = _randn(610, V, H)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(611))
    m_emb = mtp.VocabParallelEmbedding(V, H, init_method=lambda _: None, config=config, tp_group=tp)
    with torch.no_grad():
        m_emb.weight.copy_(table.chunk(TP, 0)[rank])
    _close(VocabParallelEmbedding(V, H, tp).copy_from_global_(table)(ids), m_emb(ids), "megatron-core embedding")


def _check_megatron_cross_entropy():
    """megatron-core's vocab_parallel_cross_entropy reads its global tp group (parallel_state) and computes in
    fp32: equal to ours at fp32 tolerance, without label smoothing (its smoothing term takes the rank's slice of
    the vocabulary only at tp > 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy as megatron_cross_entropy

    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, create_gloo_process_groups=False)
    try:
        tp = parallel_state.get_tensor_model_parallel_group()
        logits, target, weights = _cross_entropy_case(700)
        target[0, 1] = 3  # megatron-core has no ignore_index
        theirs = logits.chunk(TP, -1)[rank].clone().requires_grad_(True)
        ours = theirs.detach().clone().requires_grad_(True)
        megatron_cross_entropy(theirs.clone(), target).backward(weights)  # it writes over its input
        loss = vocab_parallel_cross_entropy(ours, target, tp)
        loss.backward(weights)
        expected = megatron_cross_entropy(theirs.detach().clone(), target)
        torch.testing.assert_close(loss, expected.to(DT), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.grad, theirs.grad.to(DT), rtol=1e-6, atol=1e-6)
        _check_megatron_layers(tp)
    finally:
        parallel_state.destroy_model_parallel()
    return True


def test_layers_and_loss_against_megatron_core():
    assert all(run_distributed(_check_megatron_cross_entropy, TP))


# ---- ZeRO over tensor-parallel layers: tp 2, dp 1 --------------------------------------------------------------

ZERO_STEPS = 3
ADAMW = dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))


class _TPMLP(nn.Module):
    """A dense GLU MLP as moezero's DenseMLP, from the tensor-parallel layers (group None: one process)."""

    def __init__(self, group, sequence_parallel):
        super().__init__()
        self.fc1 = ColumnParallelLinear(H, 2 * FFN, group, parts=(FFN, FFN), sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(FFN, H, group, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.fc2(_glu(self.fc1(x)))


def _zero_batch(step):
    return _randn(800 + step, B, S, H), _randn(900 + step, B, S, H)


def _replicas_identical(model, tp):
    """Every param whole on each tp rank (the row-parallel bias) holds the same bits on both."""
    for p in model.parameters():
        if tensor_shard_of(p) is None:
            copies = [torch.empty_like(p) for _ in range(TP)]
            dist.all_gather(copies, p.detach().contiguous(), group=tp)
            assert torch.equal(copies[0], copies[1]), "a replicated param drifted apart over tp"


def _zero_tp_run(stage, sequence_parallel, clip):
    """The MLP at tp 2 (each rank a data-parallel world of one: ParallelGroups.single() with the tp group) under
    ZeroOptimizer, and in one process under torch's AdamW, from the same global weights: per step the loss, the
    grad norm the optimizer saw and the largest weight difference after the step; then whether a step with a
    non-finite gradient on tp rank 1's shard only was skipped on this rank, leaving its weights as they were."""
    from moezero.parallel import ParallelGroups
    from moezero.zero import ZeroOptimizer

    tp, rank = _tp_group(), dist.get_rank()
    w, _, _ = _mlp_reference(glu=True, bias=True, seed=700)
    reference = _TPMLP(None, False)
    model = _TPMLP(tp, sequence_parallel)
    for m in (reference, model):
        m.fc1.copy_from_global_(w["w1"], w["b1"])
        m.fc2.copy_from_global_(w["w2"], w["b2"])
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    groups = dataclasses.replace(ParallelGroups.single(), tp=tp)
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=stage, clip_grad=clip, **ADAMW)
    shard = (lambda t: t.chunk(TP, 1)[rank]) if sequence_parallel else (lambda t: t)
    history = []
    for step in range(ZERO_STEPS):
        x, target = _zero_batch(step)
        ref_loss = (reference(x) - target).square().mean()
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip if clip else float("inf")))
        ref_opt.step()
        ref_opt.zero_grad()
        # each rank's share of the mean: its tokens' squared errors over the global count
        loss = (model(shard(x)) - shard(target)).square().sum() / target.numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with opt.modify_model(), torch.no_grad():  # stage 3: full params inside
            diff = max(
                float((tensor_shard_of(p).local_of(q) if tensor_shard_of(p) else q).sub(p).abs().max())
                for p, q in zip(model.parameters(), reference.parameters())
            )
            _replicas_identical(model, tp)
        history.append((float(ref_loss), ref_norm, opt.last_grad_norm, diff))
    _check_state_at_global_coordinates(opt, reference, ref_opt, tp)
    return history, _skips_non_finite_on_one_rank(model, opt, shard)


def _check_state_at_global_coordinates(opt, reference, ref_opt, tp):
    """The tp ranks' optimizer shards place their pieces in the global tensors (fused fc1 blocks, fc2's columns):
    consolidated, they are one process's weights and AdamW state."""
    from moezero.zero import consolidate

    shards = [None] * TP
    dist.all_gather_object(shards, opt.state_dict(), group=tp)
    full = consolidate(shards)
    for name, q in reference.named_parameters():
        _close(full["params"][name], q.detach(), f"consolidated {name}")
        for key in ("exp_avg", "exp_avg_sq"):
            _close(full["state"][name][key], ref_opt.state[q][key], f"consolidated {name} {key}")


def _skips_non_finite_on_one_rank(model, opt, shard):
    with opt.modify_model(), torch.no_grad():
        before = [p.detach().clone() for p in model.parameters()]
    x, target = _zero_batch(ZERO_STEPS)
    (model(shard(x)) - shard(target)).square().sum().backward()
    if dist.get_rank() == 1:  # assigned by hand: rank 1's shard of fc2's weight only
        model.fc2.weight.grad = torch.full(model.fc2.weight.shape, float("inf"), dtype=DT)
    skipped = not opt.step()
    opt.zero_grad()
    with opt.modify_model(), torch.no_grad():
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return skipped and unchanged


def _zero_tp_runs(sequence_parallel, clip):
    return {stage: _zero_tp_run(stage, sequence_parallel, clip) for stage in (0, 1, 2, 3)}


def _weight_errors(runs):
    return {stage: max(diff for *_, diff in history) for stage, (history, _) in runs.items()}


def _norm_errors(runs):
    return {stage: max(abs(norm - ref) / ref for _, ref, norm, _ in history) for stage, (history, _) in runs.items()}


def _skipped_everywhere(runs):
    return {stage: skipped for stage, (_, skipped) in runs.items()}


def test_zero_stages_over_tp_shards_match_one_process():
    """tp 2 without SP, no clipping: sharded params are plain params of the rank's dp world (of one), and the
    replicated row-parallel bias gets the whole gradient on every tp rank, so every stage's weights equal one
    process's."""
    for runs in run_distributed(_zero_tp_runs, TP, False, None):
        errors = _weight_errors(runs)
        assert max(errors.values()) < 1e-12, errors


def test_zero_grad_norm_and_clipping_over_tp_shards():
    """Clipping at 1.0 (below every step's norm): the norm sums the tp shards' squares and counts the replicated
    row-parallel bias once; a non-finite gradient on one tp rank's shard skips the step on both."""
    for runs in run_distributed(_zero_tp_runs, TP, False, 1.0):
        norms, weights = _norm_errors(runs), _weight_errors(runs)
        assert max(norms.values()) < 1e-12 and max(weights.values()) < 1e-12, (norms, weights)
        assert all(_skipped_everywhere(runs).values()), _skipped_everywhere(runs)


def test_zero_stages_over_sequence_parallel_shards():
    """Under SP the row-parallel bias (tp_partial) gets each rank's part of its gradient: summed over tp, with
    clipping, the weights and norms equal one process's and the bias stays bit-identical over tp."""
    for runs in run_distributed(_zero_tp_runs, TP, True, 1.0):
        norms, weights = _norm_errors(runs), _weight_errors(runs)
        assert max(norms.values()) < 1e-12 and max(weights.values()) < 1e-12, (norms, weights)
        assert all(_skipped_everywhere(runs).values()), _skipped_everywhere(runs)
