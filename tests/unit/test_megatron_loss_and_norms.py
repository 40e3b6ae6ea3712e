"""Megatron's --apply-layernorm-1p (zero-centred norm weights), --eod-mask-loss and --calculate-per-token-loss,
each checked by its effect: the norm computes (1 + w) with w starting at 0; the dataset masks the EOD tokens'
loss; a step's gradient is that of the global batch's token-mean loss."""

import copy
import dataclasses

import pytest
import torch

from moezero.data import load_micro_batch
from moezero.hf.families import family_for
from moezero.keyed_random import SampleKeys
from moezero.models import GPTModel
from moezero.training.loop import _micro_batch_losses, evaluate, evaluation_keys, train_step
from moezero.recipe import pretraining
from tests.integration.pretrain_utils import TINY, configs


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centred_norms_scale_by_one_plus_their_weight(normalization):
    cfg = configs(TINY + ["--apply-layernorm-1p", "--normalization", normalization, "--qk-layernorm"])
    model = GPTModel(dataclasses.replace(cfg.model, vocab_size=64), cfg.moe).double()
    plain_cfg = configs(TINY + ["--normalization", normalization, "--qk-layernorm"])
    plain = GPTModel(dataclasses.replace(plain_cfg.model, vocab_size=64), plain_cfg.moe).double()
    norms = [n for n, _ in model.named_parameters() if "norm" in n and n.endswith("weight")]
    assert len(norms) >= 2 * 2 + 1 and all(float(model.get_parameter(n).abs().sum()) == 0 for n in norms)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.1) if name in norms else None
        state = {n: (p + 1 if n in norms else p) for n, p in model.state_dict().items()}
        plain.load_state_dict(state)
    model.eval(), plain.eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    keys = SampleKeys(0, 0, (0, 1))  # the router's jitter draws the same noise for both (evaluation too)
    torch.testing.assert_close(model(tokens, keys)[0], plain(tokens, keys)[0], rtol=0, atol=1e-12)
    with pytest.raises(Exception, match="--apply-layernorm-1p"):
        family_for(dataclasses.replace(cfg.model, vocab_size=64), cfg.moe)  # no HF family stores gamma - 1


def test_eod_mask_loss_masks_the_end_of_document_tokens(tmp_path):
    masked = pretraining(configs(TINY + ["--eod-mask-loss", "--data-cache-path", str(tmp_path)])).data
    plain = pretraining(configs(TINY + ["--data-cache-path", str(tmp_path)])).data
    eod = masked.tokenizer.eod
    batch, same = load_micro_batch(masked.train, range(16)), load_micro_batch(plain.train, range(16))
    assert torch.equal(batch["tokens"], same["tokens"]) and bool((batch["tokens"] == eod).any())
    assert torch.equal(batch["loss_mask"], (batch["tokens"] != eod).float()) and bool(same["loss_mask"].all())


def _uneven_batches():
    """Two micro-batches whose loss masks keep 10 and 64 tokens."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for kept, first in ((10, 0), (64, 2)):
        mask = torch.zeros(2, 32)
        mask.view(-1)[:kept] = 1.0
        batches.append(
            {
                "tokens": torch.randint(0, 256, (2, 32), generator=g),
                "labels": torch.randint(0, 256, (2, 32), generator=g),
                "loss_mask": mask,
                "sample_index": torch.tensor([first, first + 1]),
            }
        )
    return batches


def test_the_logged_and_validation_lm_loss_is_the_token_mean(tmp_path):
    """Megatron reports the global batch's token mean (pretrain_gpt's loss_func hands (sum, tokens); training.py
    sums both over micro-batches and ranks) with or without --calculate-per-token-loss, in training and in
    validation: with 10 and 64 kept tokens that is not the mean of the two micro-batch means."""
    run = pretraining(configs(TINY + ["--data-cache-path", str(tmp_path)]))
    batches = _uneven_batches()

    def token_mean(training: bool) -> float:
        run.model.train(training)
        with torch.no_grad():  # the router jitters in evaluation too (Megatron's), keyed as evaluate() keys it
            means = [
                float(
                    _micro_batch_losses(
                        run.model,
                        b,
                        evaluation_keys(7, "valid", 3, b)
                        if not training
                        else SampleKeys(7, 0, tuple(b["sample_index"].tolist())),
                    )[0]
                )
                for b in batches
            ]
        assert abs((means[0] * 10 + means[1] * 64) / 74 - sum(means) / 2) > 1e-3  # the two rules differ here
        return (means[0] * 10 + means[1] * 64) / 74

    validation = token_mean(training=False)
    run.model.train()  # as the training loop leaves it: evaluate() turns dropout off itself
    assert evaluate(run.model, batches, None, 7, 3, "valid") == pytest.approx(validation, rel=1e-9)
    assert run.model.training
    training = token_mean(training=True)  # dropout and jitter keyed by the samples: train_step's own draws
    assert train_step(run.model, run.opt, batches, 0, 7, None).lm_loss == pytest.approx(training, rel=1e-6)
    run.groups.destroy()


def test_the_per_token_loss_step_is_the_global_batch_token_mean(tmp_path):
    """Two micro-batches with 10 and 64 kept tokens of 64: the gradient (an SGD step of lr 0.5 shows it) is
    Megatron's, (the sum of token losses + each router loss times the micro-batch's tokens, as megatron-core's
    router attaches it) / 74, not the mean of the two micro-batch means with the router losses averaged; the
    logged loss is that token mean."""
    run = pretraining(
        configs(
            TINY
            + [
                "--optimizer",
                "sgd",
                "--sgd-momentum",
                "0",
                "--clip-grad",
                "0",
                "--weight-decay",
                "0",
                "--data-cache-path",
                str(tmp_path),
            ]
        )
    )
    for group in run.opt.param_groups:
        group["lr"] = 0.5
    run.model.train()
    reference = copy.deepcopy(run.model)
    batches = _uneven_batches()
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    metrics = train_step(run.model, run.opt, batches, 0, 7, None, per_token_loss=True)
    loss, token_sum = 0.0, 0.0
    for batch in batches:
        lm, router, stats, _ = _micro_batch_losses(
            reference, batch, SampleKeys(7, 0, tuple(batch["sample_index"].tolist()))
        )
        routers = sum(s.aux_loss * 64 + s.z_loss * 64 for s in stats)  # aux_loss: each micro-batch's 64 tokens
        assert torch.allclose(routers, sum(sum(s.token_weighted.values()) for s in stats), rtol=1e-12)
        loss = loss + (lm * batch["loss_mask"].sum() + routers) / 74
        token_sum += float(lm * batch["loss_mask"].sum())
    loss.backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(
            run.model.get_parameter(name).detach(), before[name] - 0.5 * p.grad, rtol=1e-5, atol=1e-7, msg=name
        )
    assert metrics.lm_loss == pytest.approx(token_sum / 74, rel=1e-6)
    run.groups.destroy()


def test_a_non_finite_step_stops_the_run_unless_told_to_skip_it(tmp_path):
    """Megatron's --check-for-nan-in-loss-and-grad (the default outside fp16): a NaN loss and gradient stop the
    run at that step, not taken; with --no-check-for-nan-in-loss-and-grad the steps are skipped (moezero's, up to
    --max-consecutive-skipped-steps in a row)."""

    def poisoned(extra):
        run = pretraining(configs(TINY + ["--train-iters", "3", "--data-cache-path", str(tmp_path)] + extra))
        with torch.no_grad():
            run.model.embedding.weight[3:5] = float("nan")
        return run

    run = poisoned([])
    before = run.opt.skipped_steps
    with pytest.raises(
        FloatingPointError,
        match="iteration 1: the loss or the gradient is not finite .*the step was not taken and the run stops",
    ):
        run.train()
    assert run.opt.skipped_steps == before + 1 and run.iteration == 0
    run.groups.destroy()
    run = poisoned(["--no-check-for-nan-in-loss-and-grad"])
    run.train()
    assert [h["iteration"] for h in run.history] == [1, 2, 3] and run.opt.skipped_steps == 3
    run.groups.destroy()
