"""Pipeline execution (moezero/pipeline/) on 2 gloo ranks at pp 2 against one process training GPTModel on the same
global batch, float64 on the reference ops: the loss, router losses and gradient norm of every step and the final
weights to 1e-10 relative, at ZeRO stages 0, 1 and 2 (stage 2 reduces at every micro-batch's backward), with 1F1B (4
micro-batches) and all-forwards-first GPipe (1 micro-batch, fewer than the stages), untied and tied (Megatron's
default: the last stage's output layer uses a copy of the word embedding). The model has a dense first layer, MoE
layers with a shared expert, the aux loss and z-loss (the aux losses of stage 0's MoE layer reach the loss only
through the pipe), capacity drops, router jitter and dropout (keyed), and clipping is engaged (the norm counts both
stages). Cases add MTP (tied, untied, a layout's `m`), --calculate-per-token-loss, fp16's loss scaler with an
overflow on one stage, and --log-num-zeros-in-grad's count. A stage that raises ends as one line on both ranks,
without either waiting for a timeout."""

import dataclasses
import datetime

import pytest
import torch

from moezero.keyed_random import SampleKeys
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.pipeline import PipelinePlan
from moezero.pipeline.failure import PipelineFailed
from moezero.pipeline.optimizer import PipelineZeroOptimizer
from moezero.pipeline.stage_groups import PipelineGroups
from moezero.pipeline.stage_model import StageModel
from moezero.training.pipeline_step import PipelineTrainer
from moezero.training.loop import _GlobalTokens, _micro_batch_loss, _micro_batch_losses
from moezero.zero import DynamicLossScaler
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs

VOCAB, SEQ, MB, SEED, KEY_SEED, STEPS, CLIP, TOL = 64, 32, 2, 3, 7, 3, 0.05, 1e-10
# the fp16 loss scaler's case: a power of two (scaling is exact in float64), and the step whose gradient a hook on
# the last stage alone makes infinite
LOSS_SCALE, OVERFLOW_STEP = 2.0**10, 1
FLAGS = [
    "--num-layers",
    "4",
    "--moe-layer-freq",
    "[0,1,1,1]",
    "--moe-shared-expert-intermediate-size",
    "16",
    "--untie-embeddings-and-output-weights",
]
# one MTP depth (its MLP an MoE layer's, as the last layer's), with a loss scale of its own; without linear biases,
# so that every gradient element is zero by structure or not at all (the key bias's is zero but for rounding, which
# the layouts reassociate): these cases compare --log-num-zeros-in-grad's count too
MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope", "--mtp-loss-scaling-factor", "0.3"]
MTP += ["--disable-bias-linear"]
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.2, momentum=0.9, weight_decay=0.1)),
    "adamw": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))),
}


def _model_configs(tied=False, mtp=False):
    flags = [flag for flag in FLAGS if not (tied and flag == "--untie-embeddings-and-output-weights")]
    cfg = configs(TINY + flags + (MTP if mtp else []))
    return dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe


def _micro_batches(step, count):
    g = torch.Generator().manual_seed(1000 + step)
    batches = []
    for j in range(count):
        mask = torch.ones(MB, SEQ, dtype=torch.float64)
        mask.view(-1)[: 7 * j] = 0.0  # uneven kept tokens between micro-batches
        first = (step * count + j) * MB
        batches.append(
            {
                "tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
                "loss_mask": mask,
                "sample_index": torch.arange(first, first + MB),
            }
        )
    return batches


def _reference(optimizer, count, tied=False, mtp=False, per_token=False, scaled=False):
    """One process, plain torch: per step (lm loss token mean, aux loss, z loss, MTP depth loss, grad norm), final
    params; each micro-batch's loss is training.loop's (its MTP term included; `per_token`:
    --calculate-per-token-loss's, over the global batch's loss tokens; `scaled`: the fp16 loss scaler's run, whose
    step OVERFLOW_STEP overflows: skipped, the scale halved)."""
    model_cfg, moe_cfg = _model_configs(tied, mtp)
    model = GPTModel(model_cfg, moe_cfg, seed=SEED).double().train()
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), **kwargs)
    scaler = DynamicLossScaler(LOSS_SCALE, hysteresis=1)
    history = []
    for step in range(STEPS):
        token_sum, tokens, routers = 0.0, 0.0, {"aux_loss": 0.0, "z_loss": 0.0, **({"mtp_1": 0.0} if mtp else {})}
        batches = _micro_batches(step, count)
        global_tokens = _GlobalTokens(float(sum(b["loss_mask"].sum() for b in batches)), 1) if per_token else None
        for batch in batches:
            keys = SampleKeys(KEY_SEED, step, tuple(batch["sample_index"].tolist()))
            lm, router, stats, depths = _micro_batch_losses(model, batch, keys, mtp=True)
            _micro_batch_loss(model, batch, lm, router, stats, depths, count, global_tokens).backward()
            token_sum += float(lm.detach()) * float(batch["loss_mask"].sum())
            tokens += float(batch["loss_mask"].sum())
            for name, value in dict(router, **{f"mtp_{k + 1}": d for k, d in enumerate(depths)}).items():
                routers[name] += float(value.detach()) / count
        zeros = sum(int((p.grad == 0).sum()) if p.grad is not None else p.numel() for p in model.parameters())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        values = {"lm_loss": token_sum / tokens, **routers}
        skipped = scaled and step == OVERFLOW_STEP
        if not skipped:
            opt.step()
            values.update(grad_norm=norm, **({"num_zeros": float(zeros)} if mtp else {}))
        if scaled:
            scaler.update(overflow=skipped)
            values.update(skipped=float(skipped), loss_scale=scaler.scale)
        opt.zero_grad()
        history.append(values)
    history.append({"validation": _validation(model, count)})
    return history, {name: p.detach().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def _validation(model, count):
    """The evaluation's lm loss after training: its token mean over one more batch, forward only."""
    model.eval()
    token_sum, tokens = 0.0, 0.0
    for batch in _micro_batches(STEPS, count):
        keys = SampleKeys(KEY_SEED, STEPS, tuple(batch["sample_index"].tolist()))
        lm, _, _, _ = _micro_batch_losses(model, batch, keys)
        token_sum += float(lm) * float(batch["loss_mask"].sum())
        tokens += float(batch["loss_mask"].sum())
    model.train()
    return token_sum / tokens


def _build(
    zero_stage, optimizer, timeout_s=120, tied=False, vpp=None, mtp=False, layout=None, per_token=False, scaled=False
):
    groups = PipelineGroups.build(pipeline_parallel_size=2, timeout=datetime.timedelta(seconds=timeout_s))
    model_cfg, moe_cfg = _model_configs(tied, mtp)
    plan = PipelinePlan(
        num_layers=4,
        mtp_num_layers=model_cfg.mtp_num_layers,
        pipeline_model_parallel_size=2,
        num_virtual_stages_per_pipeline_rank=vpp,
        pipeline_model_parallel_layout=layout,
    )
    model = StageModel(model_cfg, moe_cfg, SEED, plan, groups.pp_rank, moe_layer=expert_parallel(groups.stage)).double()
    cls, kwargs = OPTIMIZERS[optimizer]
    scaler = DynamicLossScaler(LOSS_SCALE, hysteresis=1) if scaled else None  # fp16's, on a float64 model
    opt = PipelineZeroOptimizer(
        model,
        cls,
        groups,
        stage=zero_stage,
        bucket_size=300,
        clip_grad=CLIP,
        grad_reduce_dtype=torch.float64,
        loss_scaler=scaler,
        **kwargs,
    )
    opt.count_zeros_in_grad = True  # --log-num-zeros-in-grad
    return groups, model, opt, PipelineTrainer(model, opt, groups, MB, SEQ, per_token_loss=per_token)


# each rank's chunks' layers, by (virtual stages, layout)
PLACEMENTS = {
    (None, None): [[(0, 1)], [(2, 3)]],
    (2, None): [[(0,), (2,)], [(1,), (3,)]],
    (None, "Et|t|t|tmL"): [[(0,), (2,)], [(1,), (3,)]],
    (None, "Etttt|mL"): [[(0, 1, 2, 3)], [()]],
}


def _train(zero_stage, optimizer, count, tied=False, vpp=None, mtp=False, layout=None, per_token=False, scaled=False):
    groups, model, opt, trainer = _build(
        zero_stage, optimizer, tied=tied, vpp=vpp, mtp=mtp, layout=layout, per_token=per_token, scaled=scaled
    )
    overflow = {"now": False}
    if scaled and groups.pp_rank == 1:  # the last stage's gradient alone overflows: stage 0 must skip too

        def infinite(grad):
            return torch.full_like(grad, float("inf")) if overflow["now"] else grad

        model.final_norm.weight.register_hook(infinite)
    assert [piece.layers for piece in model.pieces] == PLACEMENTS[vpp, layout][groups.pp_rank]
    assert [bool(piece.mtp) for piece in model.pieces][-1] == (mtp and groups.pp_rank == 1)
    per = count // groups.dp_size  # each pipeline's share of the global batch's micro-batches

    def mine(step):
        return _micro_batches(step, count)[groups.dp_rank * per : (groups.dp_rank + 1) * per]

    history = []
    for step in range(STEPS):
        overflow["now"] = scaled and step == OVERFLOW_STEP
        metrics = trainer.train_step(mine(step), step, KEY_SEED)
        scaling = {"skipped": float(not metrics.stepped), "loss_scale": opt.loss_scaler.scale} if scaled else {}
        if metrics.stepped:
            scaling["grad_norm"] = metrics.grad_norm
            if mtp:  # summed over the stages, the tied weight once (the copy is no param of the last stage)
                scaling["num_zeros"] = float(opt.last_num_zeros_in_grad)
        depths = {f"mtp_{k + 1}": value for k, value in enumerate(metrics.mtp_losses)}
        history.append({"lm_loss": metrics.lm_loss, **metrics.router_losses, **depths, **scaling})
    history.append({"validation": trainer.evaluate([mine(STEPS)], KEY_SEED, STEPS)})
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    copy = model.embedding_copy.weight.detach().clone() if model.embedding_copy is not None else None
    pp_rank = groups.pp_rank
    groups.destroy()
    return history, params, copy, pp_rank


def _assert_matches_one_process(
    zero_stage, optimizer, count, tied=False, vpp=None, world=2, mtp=False, layout=None, per_token=False, scaled=False
):
    ranks = run_distributed(_train, world, zero_stage, optimizer, count, tied, vpp, mtp, layout, per_token, scaled)
    expected_history, expected_params = _reference(optimizer, count, tied, mtp, per_token, scaled)
    for history in (history for history, _, _, _ in ranks):  # every rank reports the same step metrics
        assert [sorted(step) for step in history] == [sorted(step) for step in expected_history]
        for step, (got, expected) in enumerate(zip(history, expected_history)):
            for name, value in expected.items():
                assert abs(got[name] - value) <= TOL * abs(value), (step, name, got[name], value)
    assert expected_history[0]["grad_norm"] > CLIP  # clipping engaged
    stages = [[rank for rank in ranks if rank[3] == pp_rank] for pp_rank in (0, 1)]
    assert set(stages[0][0][1]).isdisjoint(stages[1][0][1])
    for rank_params in (rank[1] for rank in ranks):  # every rank's params: its stage's, one process's values
        for name, p in rank_params.items():
            torch.testing.assert_close(p, expected_params[name], rtol=TOL, atol=1e-13, msg=name)
    assert sorted(set(stages[0][0][1]) | set(stages[1][0][1])) == sorted(expected_params)
    # tied, or MTP: the last stage's copy of the word embedding
    assert all(rank[2] is None for rank in stages[0])
    assert all((rank[2] is not None) == (tied or mtp) for rank in stages[1])
    assert ("output.weight" not in expected_params) == tied
    assert any(name.startswith("mtp.0.") for name in expected_params) == mtp
    if tied or mtp:  # the last stage's copy is the first stage's weight, bit for bit (broadcast after every step)
        assert all(torch.equal(rank[2], stages[0][0][1]["embedding.weight"]) for rank in stages[1])


@pytest.mark.parametrize("zero_stage, optimizer, mtp", [(0, "sgd", True), (1, "adamw", False)])
def test_1f1b_equals_one_process(zero_stage, optimizer, mtp):
    """MTP: the depth on the last stage takes the word embedding from a copy of stage 0's (untied: Megatron's
    embedding group holds it for the MTP alone), its loss joins the last stage's. With it
    --calculate-per-token-loss (the micro-batches keep uneven token counts): every loss weighed by its tokens over
    the global batch's, the router losses of stage 0 too."""
    _assert_matches_one_process(zero_stage, optimizer, count=4, mtp=mtp, per_token=mtp)


@pytest.mark.parametrize("zero_stage, optimizer, mtp", [(2, "sgd", False), (1, "adamw", True)])
def test_tied_embedding_and_output_weights_equal_one_process(zero_stage, optimizer, mtp):
    """Megatron's default: the last stage's output layer uses a copy of stage 0's word embedding; the weight's
    gradient is the sum of both stages' (one process's gradient of a weight used twice), counted once in the norm.
    MTP: the copy serves the depth's input too (a weight used three times). Without it, fp16's dynamic loss scaler
    (on the float64 model, its scale a power of two): the loss function scales, the copy's scaled gradient joins
    the first stage's without a second scaling, and at OVERFLOW_STEP an infinite gradient on the last stage alone
    makes both stages skip the step and halve the scale, without a wait."""
    _assert_matches_one_process(zero_stage, optimizer, count=4, tied=True, mtp=mtp, scaled=not mtp)


@pytest.mark.parametrize(
    "zero_stage, optimizer, count, vpp, layout",
    [(0, "sgd", 4, 2, None), (2, "adamw", 4, 2, None), (1, "adamw", 6, None, "Et|t|t|tmL")],
)
def test_interleaved_virtual_stages_equal_one_process(zero_stage, optimizer, count, vpp, layout):
    """pp 2 x 2 virtual stages (rank 0 holds layers 0 and 2, rank 1 layers 1 and 3), tied: torch's
    ScheduleInterleaved1F1B over gloo, whose sends all use tag 0, so an activation and a gradient of the same shape
    received out of order would swap silently; the losses and weights would then leave one process's. The layout
    string's `m` puts the MTP depth with the loss on rank 1's last virtual stage."""
    _assert_matches_one_process(
        zero_stage, optimizer, count=count, tied=True, vpp=vpp, mtp=layout is not None, layout=layout
    )


def test_two_pipelines_of_two_stages_tied_equal_one_process():
    """4 ranks: pp 2 x dp 2 (Megatron's order: stage 0 on ranks 0, 1), each pipeline 2 of the 4 micro-batches; the
    tied weight's gradient summed in each pipeline's embedding group, then averaged over dp by ZeRO 1. SGD: Adam
    would turn the reassociation noise of the key bias's gradient (zero but for rounding) into differences.
    --calculate-per-token-loss: each stage counts the global batch's loss tokens over its dp group, and the weights
    carry the dp size that ZeRO's average divides by."""
    _assert_matches_one_process(1, "sgd", count=4, tied=True, world=4, per_token=True)


def test_fewer_micro_batches_than_stages_run_gpipe_and_equal_one_process():
    """With the layout 'Etttt|mL' the last stage holds the MTP depth and the loss only: the decoder's final norm
    sits with its last layer on stage 0 and the normed hidden states cross the pipe."""
    _assert_matches_one_process(1, "sgd", count=1, mtp=True, layout="Etttt|mL")


class _Boom(RuntimeError):
    pass


# (failing stage, its layer, where it raises): stage 0 in a forward (stage 1 waits for its activation), stage 1 in a
# forward (stage 0 waits for a gradient), stage 0 in a backward (stage 1 waits for an activation), and tied, stage 0
# in its last backward (stage 1, done with the schedule, waits in the embedding group's gradient sum)
FAILURES = (
    (0, "0", "forward", False),
    (1, "2", "forward", False),
    (0, "1", "backward", False),
    (0, "1", "last backward", True),
)


def _raise_at_step(failures, step_to_fail):
    """For each failure in turn (a fresh pipeline each): what each rank raised at which step, as text."""
    out = []
    for stage, layer, where, tied in failures:
        groups, model, opt, trainer = _build(1, "sgd", timeout_s=300, tied=tied)
        failing = {"now": False, "calls": 0}

        def boom(*_):
            failing["calls"] += failing["now"]
            if failing["now"] and (where != "last backward" or failing["calls"] == 4):  # of 4 micro-batches
                raise _Boom(f"boom in the {where} of layer {layer}")

        if groups.pp_rank == stage:
            target = model.layers[layer]
            (target.register_forward_pre_hook if where == "forward" else target.register_full_backward_hook)(boom)
        result = None
        for step in range(step_to_fail + 1):
            failing["now"] = step == step_to_fail
            try:
                trainer.train_step(_micro_batches(step, 4), step, KEY_SEED)
            except PipelineFailed as error:
                result = (step, str(error))
                break
        # both ranks still hold every object of the step (the pp group included) until both have raised: only the
        # failing rank's own teardown may free the other
        torch.distributed.barrier(group=groups.world_control)
        out.append(result)
        groups.destroy()
    return out


def test_a_stage_that_raises_ends_as_one_line_on_every_rank():
    """The failing rank states the failure and closes its pipeline connections, so the other fails at once (well
    before the pp group's 300 s timeout, which would fail this call's 60 s) with the same line."""
    results = run_distributed(_raise_at_step, 2, FAILURES, 2, timeout=60, isolated=True)
    for k, (stage, layer, where, _) in enumerate(FAILURES):
        expected = (
            f"pipeline stage {stage} (rank {stage}) failed at iteration 2: _Boom: boom in the {where} of layer {layer}"
        )
        assert [rank[k] for rank in results] == [(2, expected)] * 2, (k, [rank[k] for rank in results])
