"""A dense GPT (GQA, RoPE, SwiGLU, per-head q/k norms, learnable softmax offsets, biases, hidden and attention
dropout drawn from keys; cases with MTP, learned positions and ZeRO 0) at tensor-parallel size 2
on 2 gloo ranks, with and without sequence parallelism, untied and tied, at ZeRO stages 1 and 3, against one
process training the same global model on the same micro-batches: float64, every step's loss and gradient norm
(clipping engaged) and the final weights and AdamW state (the tp ranks' optimizer shards consolidated at global
coordinates). The tp model is built as the one-process model (its experts split over ep) and then has its modules
swapped (training/tensor_parallel.py). A GPT-MoE runs at tp 2 with SP, ep 1 and ep 2 (ep folded over tp); on 4 ranks
tp 2 x dp 2, each data-parallel rank its own micro-batches. Multi-latent attention (YaRN, latent norms) runs in a
dense GPT without SP (queries from q_proj) and in the GPT-MoE with SP (queries through the q latent). The GPT-MoE's
routing options decided on the tokens a router sees (capacity drops, sinkhorn) run against one process deciding them
on each tp rank's sequence shard, global_aux_loss against one process; every step metric compared. Muon at tp 2 (and
etp 2) in each --muon-tp-mode against one process orthogonalising the whole weights or each tp rank's blocks."""

import dataclasses

import torch
import torch.distributed as dist

from moezero.config import GPTConfig
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.moe.router import TopKRouter
from moezero.parallel import ParallelGroups, expert_shard_of
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.training.loop import train_step
from moezero.training.tensor_parallel import apply_tensor_parallel
from moezero.zero import ZeroOptimizer, consolidate
from moezero.zero.muon import Muon, WholeUpdate, muon_param_groups
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import configs

TP, VOCAB, SEQ, MB, SEED, KEY_SEED, STEPS, CLIP = 2, 64, 16, 2, 3, 7, 3, 0.5
ADAMW = dict(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
GPT = GPTConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=48,
    seq_length=SEQ,
    max_position_embeddings=SEQ,
    vocab_size=VOCAB,
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    qk_layernorm=True,
    softmax_type="learnable",
    hidden_dropout=0.1,
    attention_dropout=0.1,
)


def _micro_batches(step, count=2):
    g = torch.Generator().manual_seed(1000 + step)
    batches = []
    for j in range(count):
        mask = (torch.rand(MB, SEQ, generator=g) > 0.2).double()
        first = step * 2 * MB + j * MB
        batches.append(
            {
                "tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "loss_mask": mask,
                "sample_index": torch.arange(first, first + MB),
            }
        )
    return batches


def _optimizer(model, groups, stage):
    return ZeroOptimizer(
        model,
        torch.optim.AdamW,
        groups,
        stage=stage,
        bucket_size=2000,
        grad_reduce_dtype=torch.float64,
        clip_grad=CLIP,
        **ADAMW,
    )


def _train(model, opt, group, dp_rank=0, dp_size=1):
    """Each step's (lm loss, grad norm, MTP losses): data-parallel rank `dp_rank` of `dp_size` trains on its 2 of
    the step's 2 x dp_size micro-batches (one process: all of them)."""
    history = []
    for step in range(STEPS):
        batches = _micro_batches(step, 2 * dp_size)
        if group is not None:
            batches = batches[2 * dp_rank : 2 * dp_rank + 2]
        metrics = train_step(model, opt, batches, step, KEY_SEED, group)
        history.append((metrics.lm_loss, opt.last_grad_norm, *metrics.mtp_losses))
    return history


def _check_replicas_identical(model, opt, tp):
    """Every param whole on each tp rank (norms, biases, router, shared expert, experts at ep 1) holds the same bits
    on both after the steps."""
    with opt.full_parameters():
        for name, p in model.named_parameters():
            if tensor_shard_of(p) is None and expert_shard_of(p) is None:
                copies = [torch.empty_like(p) for _ in range(TP)]
                dist.all_gather(copies, p.detach().contiguous(), group=tp)
                assert torch.equal(copies[0], copies[1]), f"{name} drifted apart over tp"


def _case(groups, untied, sequence_parallel, stage, config=GPT, moe=None):
    """The largest relative difference of the losses and norms, and the largest absolute one of the consolidated
    weights and AdamW moments, tp 2 against one process."""
    config = dataclasses.replace(config, untie_embeddings_and_output_weights=untied)
    reference = GPTModel(config, moe, seed=SEED).double().train()
    model = GPTModel(config, moe, seed=SEED, moe_layer=expert_parallel(groups)).double().train()
    model = apply_tensor_parallel(model, groups.tp, sequence_parallel)
    ref_opt = _optimizer(reference, ParallelGroups.single(), stage)
    opt = _optimizer(model, groups, stage)
    dp = groups.data_parallel_size
    expected = _train(reference, ref_opt, None, dp_size=dp)
    actual = _train(model, opt, groups.dp, groups.data_parallel_rank, dp)
    _check_replicas_identical(model, opt, groups.tp)
    curve = max(abs(a - e) / abs(e) for pair_a, pair_e in zip(actual, expected) for a, e in zip(pair_a, pair_e))
    shards = [None] * dist.get_world_size()  # every rank's: the tp shards of each dp rank's
    dist.all_gather_object(shards, opt.state_dict())
    full, ref_full = consolidate(shards), consolidate([ref_opt.state_dict()])
    assert set(full["params"]) == set(ref_full["params"]), set(full["params"]) ^ set(ref_full["params"])
    weights = max(float((full["params"][n] - p).abs().max()) for n, p in ref_full["params"].items())
    moments = max(
        float((full["state"][n][k] - s[k]).abs().max()) for n, s in ref_full["state"].items() for k in ("exp_avg",)
    )
    return curve, weights, moments


# MTP (one depth: its layer split as the decoder's, its norms and projection whole), and learned position embeddings
# (under SP looked up at the rank's positions); tied
MTP_GPT = dataclasses.replace(GPT, mtp_num_layers=1)
LEARNED_GPT = dataclasses.replace(GPT, position_embedding_type="learned_absolute")
# multi-latent attention: q_proj column-parallel, the kv latent and its norm whole, the shared RoPE key's gradient
# summed over tp (no SP)
MLA_GPT = dataclasses.replace(
    GPT,
    group_query_attention=False,
    num_query_groups=None,
    softmax_type="vanilla",
    multi_latent_attention=True,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=6,
    rope_type="yarn",
    rotary_scaling_factor=4.0,
    mscale_all_dim=1.0,
)


def _cases():
    groups = ParallelGroups.build(tensor_parallel_size=TP)
    try:
        cases = {
            (untied, sp, stage): _case(groups, untied, sp, stage)
            for untied in (True, False)
            for sp in (False, True)
            for stage in (1, 3)
        }
        for sp, stage in ((False, 1), (True, 3)):
            cases[("mtp", sp, stage)] = _case(groups, False, sp, stage, MTP_GPT)
        cases[("learned positions", True, 1)] = _case(groups, False, True, 1, LEARNED_GPT)
        cases[("mla", False, 1)] = _case(groups, True, False, 1, MLA_GPT)
        cases[(False, True, 0)] = _case(groups, False, True, 0)  # stage 0: the all-reduce reducer
        return cases
    finally:
        groups.destroy()


def test_dense_gpt_at_tp2_equals_one_process():
    """tp 2 with and without SP, untied and tied, ZeRO 1 and 3: the loss curve, norms, weights and moments of one
    process, to float64 rounding."""
    results = run_distributed(_cases, TP)
    assert results[0] == results[1]
    for case, (curve, weights, moments) in results[0].items():
        assert curve < 1e-10 and weights < 1e-12 and moments < 1e-12, (case, curve, weights, moments)


# a GPT-MoE: dense first layer, then an MoE layer of 4 experts (top 2) with a gated shared expert, the aux loss
# (micro-batch and sequence), z-loss and router jitter keyed per token, hidden and attention dropout
MOE_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
    "--num-query-groups", "2", "--ffn-hidden-size", "48", "--seq-length", str(SEQ), "--max-position-embeddings",
    str(SEQ), "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--qk-layernorm",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1]", "--moe-ffn-hidden-size", "24",
    "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "1e-2", "1e-2",
    "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-z-loss-coeff", "1e-3",
    "--moe-input-jitter-eps", "0.01", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
]  # fmt: skip
# the GPT-MoE with multi-latent attention: q and kv latents (down-projections and norms on the rank's sequence
# shard, partial gradients), up-projections column-parallel, the shared RoPE key all-gathered from the shards
GQA_AT = MOE_FLAGS.index("--group-query-attention")  # with "--num-query-groups", "2"
MLA_MOE_FLAGS = MOE_FLAGS[:GQA_AT] + MOE_FLAGS[GQA_AT + 3 :] + [
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "4", "--mscale-all-dim", "1",
]  # fmt: skip


def _moe_cases():
    """tp 2 with SP at ep 1 (experts whole on both ranks, reduced over edp = both) and ep 2 (the ep group {0, 1}
    crosses the tp coordinates: parallel folding), ZeRO 1 and 3 (and 2 at ep 2)."""
    cfg = configs(MOE_FLAGS)
    gpt, moe = dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe
    results = {}
    for ep in (1, 2):
        groups = ParallelGroups.build(expert_parallel_size=ep, tensor_parallel_size=TP)
        try:
            for stage in (1, 3) if ep == 1 else (1, 2, 3):
                results[(ep, stage)] = _case(groups, True, True, stage, gpt, moe)
            if ep == 1:
                mla = configs(MLA_MOE_FLAGS)
                results[("mla", ep, 3)] = _case(
                    groups, True, True, 3, dataclasses.replace(mla.model, vocab_size=VOCAB), mla.moe
                )
        finally:
            groups.destroy()
    return results


def test_gpt_moe_at_tp2_sp_equals_one_process():
    """The MoE model at tp 2 with SP, ep 1 and 2, ZeRO 1 and 3: one process's curve, weights and moments."""
    results = run_distributed(_moe_cases, TP)
    assert results[0] == results[1]
    for case, (curve, weights, moments) in results[0].items():
        assert curve < 1e-10 and weights < 1e-12 and moments < 1e-12, (case, curve, weights, moments)


def _four_rank_cases():
    """tp 2 x dp 2 on 4 ranks (tp {0,1} {2,3}, dp {0,2} {1,3}), each dp rank its own micro-batches: the dense
    model with SP at ZeRO 3, the MoE model at tp 2 x ep 2 (ep {0,1} {2,3}, edp {0,2} {1,3}) at ZeRO 1."""
    groups = ParallelGroups.build(tensor_parallel_size=TP)
    try:
        results = {"dense": _case(groups, False, True, 3)}
    finally:
        groups.destroy()
    cfg = configs(MOE_FLAGS)
    groups = ParallelGroups.build(expert_parallel_size=2, tensor_parallel_size=TP)
    try:
        results["moe"] = _case(groups, True, True, 1, dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe)
    finally:
        groups.destroy()
    return results


def test_tp2_by_dp2_on_four_ranks_equals_one_process():
    results = run_distributed(_four_rank_cases, 2 * TP, timeout=300)
    assert all(r == results[0] for r in results)
    for case, (curve, weights, moments) in results[0].items():
        assert curve < 1e-10 and weights < 1e-12 and moments < 1e-12, (case, curve, weights, moments)


# Routing options decided on the tokens a router sees: at tp with SP megatron-core's router sees the rank's sequence
# shard, so capacity drops and sinkhorn's balancing are the shard's. The one-process oracle decides them on each
# contiguous 1/tp block of Megatron's sequence-major [S * B] tokens: block r holds positions r S/tp .. (r+1) S/tp - 1
# of every sequence, the SP shard of tp rank r (checked on the routers' inputs).
def _moe_flags(balancing, coefficients=(), extra=()):
    """MOE_FLAGS with `balancing` (and its coefficients) for its aux and sequence aux losses, and `extra`."""
    at, end = MOE_FLAGS.index("--moe-aux-loss-coeff"), MOE_FLAGS.index("--moe-z-loss-coeff")
    flags = MOE_FLAGS[:at] + MOE_FLAGS[end:] + ["--moe-router-load-balancing-type", *balancing]
    return flags + (["--moe-aux-loss-coeff", *coefficients] if coefficients else []) + list(extra)


ROUTING_CASES = {
    "capacity probs": _moe_flags(["aux_loss"], ["1e-2"], ["--moe-expert-capacity-factor", "1.0"]),
    "capacity position padded": _moe_flags(
        ["aux_loss"],
        ["1e-2"],
        ["--moe-expert-capacity-factor", "1.25", "--moe-token-drop-policy", "position"]
        + ["--moe-pad-expert-input-to-capacity"],
    ),
    "global_aux_loss": _moe_flags(["global_aux_loss", "aux_loss"], ["1e-2", "1e-2"]),
    "sinkhorn": _moe_flags(["sinkhorn"]),
}


def _blocks(x, tp):
    """Each tp rank's sequence shard of batch-major tokens `x` (MB sequences of SEQ), batch-major as it sees it."""
    return [block.reshape(-1, *x.shape[1:]) for block in x.view(MB, SEQ, *x.shape[1:]).chunk(tp, dim=1)]


def _joined(blocks):
    return torch.cat([b.view(MB, -1, *b.shape[1:]) for b in blocks], dim=1).reshape(-1, *blocks[0].shape[1:])


def _decide_per_shard(router, tp, differs):
    """Patch one process's `router` to drop over capacity and route by sinkhorn on each shard's tokens; `differs`
    gets whether the whole micro-batch's decision would have been another."""
    drop, select = router._drop_over_capacity, router._select_sinkhorn

    def drop_per_shard(ids_TK, weights_TK, num_sequences):
        assert num_sequences == MB
        shards = [drop(i, w, MB) for i, w in zip(_blocks(ids_TK, tp), _blocks(weights_TK, tp))]
        ids = _joined([s[0] for s in shards])
        differs.append(not torch.equal(ids, drop(ids_TK, weights_TK, MB)[0]))
        return ids, _joined([s[1] for s in shards]), sum(s[2] for s in shards) / tp

    def select_per_shard(logits_TE):
        shards = [select(block) for block in _blocks(logits_TE, tp)]
        ids = _joined([s[0] for s in shards])
        differs.append(not torch.equal(ids, select(logits_TE)[0]))
        return ids, _joined([s[1] for s in shards])

    router._drop_over_capacity, router._select_sinkhorn = drop_per_shard, select_per_shard


def _first_router_inputs(model):
    """The inputs of the first MoE layer's router, call by call."""
    inputs = []
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    router.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
    return inputs


def _routing_case(groups, flags):
    """tp 2 with SP against the per-shard oracle over STEPS steps: the largest difference of every step metric
    (losses, grad norm, router losses, tracked losses, dropped fraction, tokens per expert), of the final weights
    and moments, of the first router's inputs against the oracle's block; the drop fractions; whether the oracle's
    shard decisions ever differed from the whole micro-batch's."""
    cfg = configs(flags)
    gpt, moe = dataclasses.replace(cfg.model, vocab_size=VOCAB, untie_embeddings_and_output_weights=True), cfg.moe
    reference = GPTModel(gpt, moe, seed=SEED).double().train()
    model = GPTModel(gpt, moe, seed=SEED, moe_layer=expert_parallel(groups)).double().train()
    model = apply_tensor_parallel(model, groups.tp, True)
    differs = []
    for router in (m for m in reference.modules() if isinstance(m, TopKRouter)):
        _decide_per_shard(router, TP, differs)
    ref_inputs, inputs = _first_router_inputs(reference), _first_router_inputs(model)
    ref_opt, opt = _optimizer(reference, ParallelGroups.single(), 1), _optimizer(model, groups, 1)
    expected, actual = [], []
    for step in range(STEPS):
        batches = _micro_batches(step)
        expected.append(train_step(reference, ref_opt, batches, step, KEY_SEED, None))
        actual.append(train_step(model, opt, batches, step, KEY_SEED, groups.world_control, tensor_parallel_size=TP))
    rank = dist.get_rank(groups.tp)
    shards = max(float((_blocks(r, TP)[rank] - x).abs().max()) for r, x in zip(ref_inputs, inputs))
    metrics = max(_metric_differences(a, e) for a, e in zip(actual, expected))
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, opt.state_dict())
    full, ref_full = consolidate(states), consolidate([ref_opt.state_dict()])
    weights = max(float((full["params"][n] - p).abs().max()) for n, p in ref_full["params"].items())
    moments = max(float((full["state"][n]["exp_avg"] - s["exp_avg"]).abs().max()) for n, s in ref_full["state"].items())
    dropped = [float(m.dropped_fraction.sum()) for m in actual]
    return dict(metrics=metrics, weights=weights, moments=moments, shards=shards, dropped=dropped, differs=any(differs))


def _metric_differences(actual, expected):
    scalars = [(actual.lm_loss, expected.lm_loss), (actual.grad_norm, expected.grad_norm)]
    scalars += [(actual.router_losses[k], v) for k, v in expected.router_losses.items()]
    tensors = [(actual.dropped_fraction, expected.dropped_fraction)]
    tensors += [(actual.tokens_per_expert, expected.tokens_per_expert)]
    tensors += [(actual.layer_tracked_losses[k], v) for k, v in expected.layer_tracked_losses.items()]
    assert set(actual.layer_tracked_losses) == set(expected.layer_tracked_losses)
    return max([abs(a - e) for a, e in scalars] + [float((a - e).abs().max()) for a, e in tensors])


def _routing_cases():
    """Every case at etp 1 (experts whole on both ranks), capacity drops also at Megatron's default etp = tp."""
    groups = ParallelGroups.build(tensor_parallel_size=TP)
    try:
        results = {name: _routing_case(groups, flags) for name, flags in ROUTING_CASES.items()}
    finally:
        groups.destroy()
    groups = ParallelGroups.build(tensor_parallel_size=TP, expert_tensor_parallel_size=TP)
    try:
        results["capacity probs, etp 2"] = _routing_case(groups, ROUTING_CASES["capacity probs"])
    finally:
        groups.destroy()
    return results


def test_moe_routing_options_at_tp2_sp_equal_the_per_shard_oracle():
    """Capacity drops (both policies, padded), global_aux_loss and sinkhorn at tp 2 with SP: the run of one process
    whose router decides on each shard's tokens (megatron-core's semantics), every step metric counted once."""
    results = run_distributed(_routing_cases, TP)
    for name, r in results[0].items():
        assert all(rank[name]["shards"] < 1e-12 for rank in results), name  # the oracle's blocks: the shards
        assert {k: v for k, v in r.items() if k != "shards"} == {
            k: v for k, v in results[1][name].items() if k != "shards"
        }
        assert r["metrics"] < 1e-10 and r["weights"] < 1e-12 and r["moments"] < 1e-12, (name, r)
        if name.startswith("capacity"):  # drops happen, and decided per shard they are not the whole batch's
            assert min(r["dropped"]) > 0 and r["differs"], (name, r)
        if name == "sinkhorn":
            assert r["differs"], (name, r)


# Muon at tp (megatron-core's TensorParallelMuon): blockwise orthogonalises each tp rank's shard of a weight (its
# own QKV blocks, the fused fc1's [gate | up] shard together), scaled by the shard's shape; duplicated (and
# distributed) the whole weight, scaled by its global shape; expert weights over the etp group
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, scale_mode="unit_rms_norm", extra_scale_factor=1.5)


class BlockwiseOracleMuon(Muon):
    """One process's Muon that orthogonalises each weight in the tp ranks' blocks of it (`tp_shards`: {id(param):
    each tp rank's TensorShard of it}), each block as Muon orthogonalises a whole weight (its QKV rows split at
    1/TP of the global heads' sizes)."""

    def __init__(self, *args, tp_shards, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp_shards = tp_shards

    def _orthogonalised(self, p, whole, group):
        shards = self.tp_shards.get(id(self.whole_params.piece_of[p].param.param))
        if shards is None:
            return super()._orthogonalised(p, whole, group)
        splits = group.get("muon_split_rows")
        local_group = dict(group, muon_split_rows=tuple(n // TP for n in splits)) if splits else group
        out = torch.empty_like(whole.value)
        for shard in shards:
            local = shard.local_of(whole.value)
            orth = super()._orthogonalised(
                local, WholeUpdate(local, (0, local.numel()), whole.expert_stack), local_group
            )
            at = 0
            for lo, hi in shard.blocks:
                out.narrow(shard.dim, lo, hi - lo).copy_(orth.narrow(shard.dim, at, hi - lo))
                at += hi - lo
        return out.reshape(-1)[whole.piece_range[0] : whole.piece_range[1]].view_as(p)


def _muon_optimizer(model, groups, stage, cls=Muon, **kwargs):
    return ZeroOptimizer(
        model,
        cls,
        groups,
        stage=stage,
        bucket_size=2000,
        grad_reduce_dtype=torch.float64,
        clip_grad=CLIP,
        param_groups=muon_param_groups(model, MUON["weight_decay"]),
        fp32_matmul_prec="high",
        **{k: v for k, v in MUON.items() if k != "weight_decay"},
        **kwargs,
    )


def _muon_case(groups, mode, stage, config=GPT, moe=None):
    """The largest relative difference of the losses and norms and the largest absolute one of the consolidated
    weights and optimizer state (Muon's momentum buffers, Adam's moments), tp 2 in `mode` against the oracle."""
    reference = GPTModel(config, moe, seed=SEED).double().train()
    model = GPTModel(config, moe, seed=SEED, moe_layer=expert_parallel(groups)).double().train()
    if groups.tp is not None:
        model = apply_tensor_parallel(model, groups.tp, moe is not None)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, {n: tensor_shard_of(p) for n, p in model.named_parameters()})
    if mode == "blockwise":
        named = dict(reference.named_parameters())
        tp_shards = {id(named[n]): [s[n] for s in shards] for n, shard in shards[0].items() if shard is not None}
        ref_opt = _muon_optimizer(reference, ParallelGroups.single(), stage, BlockwiseOracleMuon, tp_shards=tp_shards)
    else:
        ref_opt = _muon_optimizer(reference, ParallelGroups.single(), stage)
    opt = _muon_optimizer(model, groups, stage, tp_mode=mode)
    expected, actual = _train(reference, ref_opt, None), _train(model, opt, groups.dp)
    _check_replicas_identical(model, opt, groups.tp)
    curve = max(abs(a - e) / abs(e) for pair_a, pair_e in zip(actual, expected) for a, e in zip(pair_a, pair_e))
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, opt.state_dict())
    full, ref_full = consolidate(states), consolidate([ref_opt.state_dict()])
    weights = max(float((full["params"][n] - p).abs().max()) for n, p in ref_full["params"].items())
    state = max(
        float((full["state"][n][k] - t).abs().max())
        for n, s in ref_full["state"].items()
        for k, t in s.items()
        if k != "step"
    )
    return curve, weights, state, ref_full["params"]


def _muon_cases():
    """The dense GPT (GQA's split QKV, SwiGLU's fused fc1) at tp 2, each mode, ZeRO 0, 1 and 3; the GPT-MoE at tp 2 and
    etp 2 with SP (expert stacks split over etp), blockwise and duplicated, and at tp 1 etp 2 (the experts' gathers
    over etp, the dense weights whole) at ZeRO 2."""
    results, weights = {}, {}
    groups = ParallelGroups.build(tensor_parallel_size=TP)
    try:
        for mode, stage in (("blockwise", 1), ("duplicated", 0), ("distributed", 3)):
            *results[(mode, stage)], weights[mode] = _muon_case(groups, mode, stage)
    finally:
        groups.destroy()
    cfg = configs(MOE_FLAGS)
    gpt = dataclasses.replace(cfg.model, vocab_size=VOCAB, untie_embeddings_and_output_weights=True)
    groups = ParallelGroups.build(tensor_parallel_size=TP, expert_tensor_parallel_size=TP)
    try:
        for mode, stage in (("blockwise", 3), ("duplicated", 1)):
            *results[("moe", mode, stage)], _ = _muon_case(groups, mode, stage, gpt, cfg.moe)
    finally:
        groups.destroy()
    groups = ParallelGroups.build(expert_tensor_parallel_size=TP)
    try:
        *results[("moe etp only", "duplicated", 2)], _ = _muon_case(groups, "duplicated", 2, gpt, cfg.moe)
    finally:
        groups.destroy()
    modes_differ = max(float((weights["blockwise"][n] - w).abs().max()) for n, w in weights["duplicated"].items())
    return results, modes_differ


def test_muon_at_tp2_equals_megatrons_modes():
    """--muon-tp-mode at tp 2 (and etp 2): duplicated and distributed equal one process's Muon, blockwise one process
    orthogonalising each tp rank's blocks; loss curve, norms, weights and optimizer state to float64 rounding."""
    results = run_distributed(_muon_cases, TP)
    assert results[0] == results[1]
    cases, modes_differ = results[0]
    for case, (curve, weights, state) in cases.items():
        assert curve < 1e-10 and weights < 1e-12 and state < 1e-12, (case, curve, weights, state)
    assert modes_differ > 1e-4  # the two oracles differ: each mode is pinned
