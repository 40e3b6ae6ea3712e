"""A dense GPT (GQA, RoPE, SwiGLU, per-head q/k norms, learnable softmax offsets, biases, hidden and attention
dropout drawn from keys; cases with MTP, learned positions and ZeRO 0) at tensor-parallel size 2
on 2 gloo ranks, with and without sequence parallelism, untied and tied, at ZeRO stages 1 and 3, against one
process training the same global model on the same micro-batches: float64, every step's loss and gradient norm
(clipping engaged) and the final weights and AdamW state (the tp ranks' optimizer shards consolidated at global
coordinates). The tp model is built as the one-process model (its experts split over ep) and then has its modules
swapped (training/tensor_parallel.py). A GPT-MoE runs at tp 2 with SP, ep 1 and ep 2 (ep folded over tp); on 4 ranks
tp 2 x dp 2, each data-parallel rank its own micro-batches. Multi-latent attention (YaRN, latent norms) runs in a
dense GPT without SP (queries from q_proj) and in the GPT-MoE with SP (queries through the q latent)."""

import dataclasses

import torch
import torch.distributed as dist

from moezero.config import GPTConfig
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.parallel import ParallelGroups, expert_shard_of
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.training.loop import train_step
from moezero.training.tensor_parallel import apply_tensor_parallel
from moezero.zero import ZeroOptimizer, consolidate
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
