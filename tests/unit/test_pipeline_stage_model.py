"""StageModel (moezero/pipeline/stage_model.py) against GPTModel, in one process: the stages' params together are
GPTModel's, by name and value, and the stages' forwards composed by hand give GPTModel's loss (the lm loss plus
every MoE layer's router losses, plus the MTP depths' with --mtp-num-layers) and the same gradients."""

import dataclasses

import pytest
import torch

from moezero.keyed_random import SampleKeys
from moezero.models import GPTModel
from moezero.pipeline import PipelinePlan
from moezero.pipeline.stage_model import StageModel
from moezero.training.loop import _micro_batch_loss, _micro_batch_losses
from tests.integration.pretrain_utils import TINY, configs

VOCAB, SEQ, MB, SEED = 64, 32, 2, 3
# dense first layer, then MoE layers with a shared expert; aux loss, z-loss, jitter, capacity and dropout from TINY
FLAGS = [
    "--num-layers",
    "4",
    "--moe-layer-freq",
    "[0,1,1,1]",
    "--moe-shared-expert-intermediate-size",
    "16",
    "--untie-embeddings-and-output-weights",
]
MTP = ["--mtp-num-layers", "2", "--position-embedding-type", "rope", "--mtp-loss-scaling-factor", "0.3"]


def _configs(flags=(), tied=False):
    cfg = configs(
        TINY + [f for f in FLAGS if not (tied and f == "--untie-embeddings-and-output-weights")] + list(flags)
    )
    return dataclasses.replace(cfg.model, vocab_size=VOCAB), cfg.moe


def _stages(model_cfg, moe_cfg, plan):
    return [StageModel(model_cfg, moe_cfg, SEED, plan, r).double().train() for r in range(plan.pp)]


def _batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(MB, SEQ, dtype=torch.float64)
    mask[0, :5] = 0.0
    return {
        "tokens": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (MB, SEQ), generator=g),
        "loss_mask": mask,
        "sample_index": torch.arange(4, 4 + MB),
    }


@pytest.mark.parametrize(
    "pp, first, tied, mtp, layout",
    [
        (2, None, False, False, None),
        (3, 2, False, False, None),
        (2, 1, False, False, None),
        (2, None, True, False, None),
        (2, None, False, True, None),
        (2, None, True, True, None),
        (2, None, False, True, "Etttt|mmL"),
    ],
)
def test_stages_hold_gptmodels_params_by_name_and_value(pp, first, tied, mtp, layout):
    """Tied or MTP: the last stage's copy of the word embedding (not one of its params) equals it, in the model's
    dtype; the MTP depths sit on the last stage (a layout's `m`: with the loss, the final norm with the last layer)."""
    model_cfg, moe_cfg = _configs(MTP if mtp else (), tied=tied)
    plan = PipelinePlan(
        num_layers=4,
        mtp_num_layers=model_cfg.mtp_num_layers,
        pipeline_model_parallel_size=pp,
        decoder_first_pipeline_num_layers=first,
        pipeline_model_parallel_layout=layout,
    )
    full = dict(GPTModel(model_cfg, moe_cfg, seed=SEED).double().named_parameters())
    union = {}
    stages = _stages(model_cfg, moe_cfg, plan)
    for stage in stages:
        for name, p in stage.named_parameters():
            assert name not in union, f"{name} on two stages"
            union[name] = p
    assert list(union) == list(full)  # the same names, in GPTModel's order
    for name, p in full.items():
        assert torch.equal(union[name], p), name
    copies = [stage.embedding_copy for stage in stages]
    assert [c is not None for c in copies] == [False] * (pp - 1) + [tied or mtp]
    assert [stage.mtp is not None for stage in stages] == [False] * (pp - 1) + [mtp]
    if tied or mtp:
        assert copies[-1].weight.dtype == torch.float64 and torch.equal(copies[-1].weight, full["embedding.weight"])


@pytest.mark.parametrize("tied, mtp", [(False, False), (True, False), (False, True), (True, True)])
def test_composed_stages_give_gptmodels_loss_and_gradients(tied, mtp):
    """Stage 0 (embedding, dense layer, an MoE layer) hands (hidden, aux) to stage 1 (MoE layers, norm, head; with
    MTP its depths, MoE layers too): its loss is GPTModel's lm + Σ router losses (+ the scaled MTP losses) exactly,
    and backward through the hand-off gives GPTModel's gradients (tied or MTP: the word embedding's is the sum of
    stage 0's and the last stage's copy's)."""
    model_cfg, moe_cfg = _configs(MTP if mtp else (), tied=tied)
    plan = PipelinePlan(num_layers=4, mtp_num_layers=model_cfg.mtp_num_layers, pipeline_model_parallel_size=2)
    first, last = _stages(model_cfg, moe_cfg, plan)
    full = GPTModel(model_cfg, moe_cfg, seed=SEED).double().train()
    batch = _batch()
    keys = SampleKeys(7, 5, tuple(batch["sample_index"].tolist()))
    lm, router, stats, depths = _micro_batch_losses(full, batch, keys, mtp=True)
    assert len(depths) == (2 if mtp else 0)
    expected = _micro_batch_loss(full, batch, lm, router, stats, depths, 1, None)
    expected.backward()

    kwargs = {"seed": 7, "iteration": 5, "sample_index": batch["sample_index"]}
    hidden, aux = first(0, batch["tokens"], **kwargs)
    sent_hidden, sent_aux = hidden.detach().requires_grad_(), aux.detach().requires_grad_()
    head = {"labels": batch["labels"], "loss_mask": batch["loss_mask"], "tokens": batch["tokens"]}
    loss = last(0, sent_hidden, sent_aux, **head, **kwargs)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=0)
    loss.backward()
    torch.autograd.backward([hidden, aux], [sent_hidden.grad, sent_aux.grad])
    assert sent_aux.grad == 1.0  # the aux losses' gradient returns through the pipe
    grads = {name: p.grad for stage in (first, last) for name, p in stage.named_parameters()}
    if tied or mtp:
        grads["embedding.weight"] = grads["embedding.weight"] + last.embedding_copy.weight.grad
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_full_recompute_counts_each_stages_own_layers():
    """--recompute-method block --recompute-num-layers 1: the first layer *of each stage* is recomputed (Megatron
    counts per stage); the loss and gradients stay GPTModel's."""
    model_cfg, moe_cfg = _configs(
        ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
    )
    plan = PipelinePlan(num_layers=4, pipeline_model_parallel_size=2)
    first, last = _stages(model_cfg, moe_cfg, plan)
    calls = []
    for stage in (first, last):
        stage._layers = _counting(stage._layers, calls)
    batch = _batch()
    kwargs = {"seed": 7, "iteration": 0, "sample_index": batch["sample_index"]}
    hidden, aux = first(0, batch["tokens"], **kwargs)
    loss = last(0, hidden, aux, labels=batch["labels"], loss_mask=batch["loss_mask"], **kwargs)
    loss.backward()
    assert calls == [(0,), (1,), (2,), (3,), (2,), (0,)]  # forwards, then the recomputed first layer of each


def _counting(run, calls):
    def wrapped(layers, x, keys):
        calls.append(tuple(layers))
        return run(layers, x, keys)

    return wrapped
