"""Context parallelism (moezero/context_parallel.py) on 2 gloo ranks at cp 2 against one process training GPTModel
on the whole micro-batches, float64 on the reference ops: the lm loss, router losses, MTP loss and gradient norm of
every step and the final weights to 1e-10 relative. Both ranks read the same micro-batches (one cp group) and keep
chunks r and 3 - r of every sequence. Cases: an MoE model (aux loss, z-loss, router jitter, attention and hidden
dropout, all keyed) with learned positions at ZeRO 1; the same with its experts split over the same two ranks (cp 2
x ep 2) at ZeRO 3 and the sequence aux loss; a dense GQA model with RoPE, a sliding window on one layer, learnable
sinks, layer scaling and an MTP depth at ZeRO 2; --calculate-per-token-loss at ZeRO 0; the global-batch aux loss
with full recompute (the K/V gathers run again in backward) and the micro-batches' forwards interleaved at cp 2 x
ep 2; --cp-comm-type a2a (Ulysses) on one layer and p2p on the other, with GQA, RoPE and sinks; multi-latent
attention (q and kv latents with norms, YaRN, attention dropout) with a2a on one layer and p2p on the other at cp 2 x
ep 2, ZeRO 3."""

import dataclasses

import pytest
import torch

from moezero.keyed_random import SampleKeys
from moezero.models import GPTModel
from moezero.moe import expert_parallel, reset_global_load_balancing
from moezero.parallel import ParallelGroups
from moezero.context_parallel import ContextParallel
from moezero.training.loop import _GlobalTokens, _micro_batch_loss, _micro_batch_losses, train_step
from moezero.zero import ZeroOptimizer
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs

VOCAB, SEQ, MB, SEED, KEY_SEED, STEPS, CLIP, TOL = 64, 32, 2, 3, 7, 3, 0.05, 1e-10
MICRO_BATCHES = 2
# capacity drops are decided on each rank's own tokens (megatron-core's too): not those of one process
NO_CAPACITY = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]]
GQA = ["--group-query-attention", "--num-query-groups", "1", "--num-attention-heads", "4", "--kv-channels", "8"]
CASES = {
    "moe_zero1": dict(flags=["--moe-layer-freq", "[0,1]"], stage=1, ep=1),
    "moe_ep2_zero3": dict(flags=["--moe-router-load-balancing-type", "seq_aux_loss"], stage=3, ep=2),
    "dense_gqa_rope_window_mtp_zero2": dict(
        flags=GQA
        + ["--position-embedding-type", "rope", "--window-size", "5,0", "--window-attn-skip-freq", "2"]
        + ["--softmax-type", "learnable", "--apply-query-key-layer-scaling", "--mtp-num-layers", "1"]
        + ["--mtp-loss-scaling-factor", "0.3", "--num-experts", "0"],
        stage=2,
        ep=1,
    ),
    "per_token_zero0": dict(flags=["--moe-layer-freq", "[1,0]"], stage=0, ep=1, per_token=True),
    "global_aux_recompute_overlap_zero2": dict(
        flags=["--moe-router-load-balancing-type", "global_aux_loss", "--recompute-granularity", "full"]
        + ["--recompute-method", "uniform", "--recompute-num-layers", "1"],
        stage=2,
        ep=2,
        overlap=True,
    ),
    # Ulysses on the first layer, the all-gather (p2p's) on the second: 4 heads, 2 query groups, 2 per rank
    "a2a_and_p2p_gqa_rope_sinks_zero1": dict(
        flags=["--group-query-attention", "--num-query-groups", "2", "--num-attention-heads", "4"]
        + ["--kv-channels", "8", "--position-embedding-type", "rope", "--softmax-type", "learnable"],
        stage=1,
        ep=2,
        comm_types=("a2a", "p2p"),
    ),
    # MLA: RoPE/YaRN of the shared key at the rank's global positions, all-gathered once (p2p) or per head (a2a)
    "mla_a2a_and_p2p_zero3": dict(
        flags=["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8"]
        + ["--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--rotary-scaling-factor", "4", "--mscale-all-dim", "1"]
        + ["--qk-layernorm", "--num-attention-heads", "4", "--position-embedding-type", "rope"],
        stage=3,
        ep=2,
        comm_types=("a2a", "p2p"),
    ),
}


def _model_configs(flags):
    """(GPTConfig, MoEConfig or None: `--num-experts 0` in `flags` builds a dense model)."""
    dense = "--num-experts" in flags and flags[flags.index("--num-experts") + 1] == "0"
    cfg = configs(NO_CAPACITY + [flag for flag in flags if flag not in ("--num-experts", "0")])
    return dataclasses.replace(cfg.model, vocab_size=VOCAB), None if dense else cfg.moe


def _micro_batches(step):
    g = torch.Generator().manual_seed(1000 + step)
    batches = []
    for j in range(MICRO_BATCHES):
        mask = torch.ones(MB, SEQ, dtype=torch.float64)
        mask.view(-1)[: 11 * (j + 1)] = 0.0  # uneven kept tokens, mostly in one cp rank's chunks
        first = (step * MICRO_BATCHES + j) * MB
        batches.append(
            {
                "tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "loss_mask": mask,
                "sample_index": torch.arange(first, first + MB),
            }
        )
    return batches


def _reference(case):
    """One process, plain torch SGD with clipping: per step (lm loss token mean, router losses, MTP loss, grad norm),
    final params."""
    spec = CASES[case]
    model = GPTModel(*_model_configs(spec["flags"]), seed=SEED).double().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    history = []
    for step in range(STEPS):
        batches = _micro_batches(step)
        total = float(sum(b["loss_mask"].sum() for b in batches))
        global_tokens = _GlobalTokens(total, 1) if spec.get("per_token") else None
        token_sum, values = 0.0, {"aux_loss": 0.0, "z_loss": 0.0, "mtp": 0.0}
        for batch in batches:
            keys = SampleKeys(KEY_SEED, step, tuple(batch["sample_index"].tolist()))
            lm, router, stats, depths = _micro_batch_losses(model, batch, keys, mtp=True)
            _micro_batch_loss(model, batch, lm, router, stats, depths, len(batches), global_tokens).backward()
            token_sum += float(lm.detach()) * float(batch["loss_mask"].sum())
            for name, value in dict(router, mtp=sum(depths, lm.new_zeros(()))).items():
                values[name] += float(value.detach()) / len(batches)
        values.update(
            lm_loss=token_sum / total, grad_norm=float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        )
        opt.step()
        opt.zero_grad()
        reset_global_load_balancing(model)  # as train_step: the global-batch aux loss counts each step afresh
        history.append(values)
    return history, {name: p.detach().clone() for name, p in model.named_parameters()}


def _cp_run(case):
    """Rank body: cp 2 (x ep), ZeRO; every rank's history and full params."""
    spec = CASES[case]
    groups = ParallelGroups.build(expert_parallel_size=spec["ep"], context_parallel_size=2)
    try:
        cp = ContextParallel(groups.cp, spec.get("comm_types", ("p2p",)))
        model_cfg, moe_cfg = _model_configs(spec["flags"])
        model = GPTModel(model_cfg, moe_cfg, seed=SEED, moe_layer=expert_parallel(groups), context_parallel=cp)
        model = model.double().train()
        opt = ZeroOptimizer(
            model,
            torch.optim.SGD,
            groups,
            stage=spec["stage"],
            bucket_size=700,
            clip_grad=CLIP,
            grad_reduce_dtype=torch.float64,
            lr=0.2,
            momentum=0.9,
        )
        history = []
        for step in range(STEPS):
            m = train_step(
                model,
                opt,
                _micro_batches(step),
                step,
                KEY_SEED,
                groups.dp,
                per_token_loss=spec.get("per_token", False),
                overlap_moe_comm=spec.get("overlap", False),
                context_parallel=cp,
            )
            history.append(dict(m.router_losses, mtp=sum(m.mtp_losses), lm_loss=m.lm_loss, grad_norm=m.grad_norm))
        with opt.full_parameters():
            params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return history, {name: (groups.ep_rank if ".experts." in name else None, t) for name, t in params.items()}
    finally:
        groups.destroy()


def _close(a, b):
    return abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_trains_as_one_process(case):
    expected_history, expected = _reference(case)
    results = run_distributed(_cp_run, 2, case)
    ep = CASES[case]["ep"]
    for history, params in results:
        for step, (got, want) in enumerate(zip(history, expected_history)):
            for name, value in want.items():
                assert _close(got[name], value), (case, step, name, got[name], value)
        for name, (ep_rank, tensor) in params.items():
            want = expected[name]
            if ep_rank is not None and ep > 1:
                per = want.shape[0] // ep
                want = want[ep_rank * per : (ep_rank + 1) * per]
            scale = max(1.0, float(want.abs().max()))
            assert float((tensor - want).abs().max()) <= TOL * scale, (case, name)
