"""QAT across layouts: loss curves on 1 and 2 ranks (ep 1, 2; ZeRO 0, 1, 2), and the exported model on
1 and 2 ranks against the fake-quant model."""

import torch

from moezero.compression.evaluation import eval_dataset, lm_loss
from moezero.compression.export import export_quantized
from moezero.compression.inference import load_checkpoint_weights, load_quantized_model
from moezero.compression.source import load_checkpoint_model
from moezero.data import load_micro_batch
from moezero.parallel import ParallelGroups
from tests.dist_utils import run_distributed
from moezero.recipe import pretraining
from tests.integration.pretrain_utils import TINY, assert_same_curve, configs, train

QAT = ["--qat-weight-bits", "4", "--qat-groups", "16", "--qat-modules", "attention,experts,router"]
ITERS = ["--train-iters", "8", "--fp64"]
# float64: layouts reassociate sums, so master weights differ by ~1e-16 relative between layouts; in
# fp32 (~1e-7) a weight right at a rounding boundary lands on the other grid point on some CPUs (seen:
# 3.2e-5 on an AVX-512 machine). In float64 such a flip needs a weight within ~1e-16 of a boundary.
LAYOUT_RTOL = 1e-9


def _curve(argv, cache_dir):
    return [h["lm_loss"] for h in train(argv, cache_dir)]


def _two_rank_curves(cache_dir, extra):
    runs = {}
    for ep, stage in ((1, 2), (2, 0), (2, 1), (2, 2), (1, 3), (2, 3)):
        argv = TINY + ITERS + QAT + extra + ["--expert-model-parallel-size", str(ep), "--zero-stage", str(stage)]
        runs[f"2 ranks ep{ep} stage{stage}"] = _curve(argv, cache_dir)
    return runs


def _worst(curve, reference):
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference))


def test_qat_loss_curves_agree_across_layouts_and_stages(tmp_path):
    cache = str(tmp_path)
    single = {stage: _curve(TINY + ITERS + QAT + ["--zero-stage", str(stage)], cache) for stage in (0, 2)}
    plain = _curve(TINY + ITERS, cache)
    assert _worst(single[2], plain) > 1e-4, "QAT must change the loss curve"
    curves = run_distributed(_two_rank_curves, 2, cache, [], timeout=300)[0]
    curves["1 rank stage0"] = single[0]
    for name, curve in curves.items():
        assert _worst(curve, single[2]) < LAYOUT_RTOL, (name, curve, single[2])


def test_stochastic_rounding_is_layout_invariant(tmp_path):
    extra = ["--qat-rounding", "stochastic"]
    single = _curve(TINY + ITERS + QAT + extra, str(tmp_path))
    nearest = _curve(TINY + ITERS + QAT, str(tmp_path))
    assert single != nearest
    ep2 = run_distributed(
        _curve, 2, TINY + ITERS + QAT + extra + ["--expert-model-parallel-size", "2"], str(tmp_path), timeout=300
    )[0]
    assert _worst(ep2, single) < LAYOUT_RTOL


# ---- the exported model on 1 and 2 ranks ---------------------------------------------------------------
def _logits_and_loss(exported, ckpt, ep, cache_dir):
    """Logits of the quantized and fake-quant models on fixed tokens, and the eval loss, on this layout."""
    groups = ParallelGroups.build(expert_parallel_size=ep)
    try:
        source = load_checkpoint_model(ckpt)
        quantized, spec = load_quantized_model(exported, groups)
        fake = load_checkpoint_weights(source, groups, fake_quant=spec)
        data = configs(TINY + ["--data-cache-path", cache_dir]).data
        dataset = eval_dataset(data, 32, 7, 12)
        tokens = load_micro_batch(dataset, [0, 1, 2])["tokens"]
        with torch.no_grad():
            out = quantized(tokens)[0], fake(tokens)[0]
        return out + (lm_loss(quantized, dataset, 12, 2, groups),)
    finally:
        groups.destroy()


def test_exported_model_matches_the_fake_quant_model_on_1_and_2_ranks(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(TINY + QAT + ["--train-iters", "3", "--save", ckpt], str(tmp_path))
    source = load_checkpoint_model(ckpt)
    exported = export_quantized(source, source.qat)
    path = str(tmp_path / "model.mzq")
    torch.save(exported, path)
    q1, fake1, loss1 = _logits_and_loss(path, ckpt, 1, str(tmp_path))
    fp = load_checkpoint_weights(source)
    tokens = load_micro_batch(
        eval_dataset(configs(TINY + ["--data-cache-path", str(tmp_path)]).data, 32, 7, 12), [0, 1, 2]
    )["tokens"]
    with torch.no_grad():
        assert (fp(tokens)[0] - fake1).abs().max() > 1e-3  # quantization shows in the output
    assert torch.equal(q1, fake1)  # one rank: bit-identical
    for ep in (1, 2):
        for q, fake, loss in run_distributed(_logits_and_loss, 2, path, ckpt, ep, str(tmp_path), timeout=300):
            assert torch.allclose(q, fake1, rtol=0, atol=1e-5), (ep, (q - fake1).abs().max())
            assert torch.allclose(fake, fake1, rtol=0, atol=1e-5)
            assert abs(loss - loss1) < 1e-6 * loss1


def test_quantized_export_from_a_stage3_checkpoint(tmp_path):
    """The export reads the checkpoint's master weights, whatever stage wrote them: stage 3 and stage 2
    runs (float64) export the same codes and scales."""
    exports = []
    for stage in (2, 3):
        ckpt = str(tmp_path / f"ckpt{stage}")
        run_distributed(
            train,
            2,
            TINY
            + QAT
            + [
                "--train-iters",
                "3",
                "--fp64",
                "--zero-stage",
                str(stage),
                "--expert-model-parallel-size",
                "2",
                "--save",
                ckpt,
            ],
            str(tmp_path),
            timeout=300,
        )
        source = load_checkpoint_model(ckpt)
        exports.append(export_quantized(source, source.qat))
    stage2, stage3 = exports
    assert stage2["quantized"].keys() == stage3["quantized"].keys() and len(stage2["quantized"]) > 0
    for name, entry in stage2["quantized"].items():  # integer codes equal; scales to float64 reassociation
        for key, value in entry.items():
            if torch.is_tensor(value):
                tol = dict(rtol=0, atol=0) if not value.is_floating_point() else dict(rtol=1e-9, atol=1e-13)
                torch.testing.assert_close(
                    stage3["quantized"][name][key], value, **tol, msg=lambda m: f"{name}.{key}: {m}"
                )
    for name, value in stage2["tensors"].items():
        torch.testing.assert_close(stage3["tensors"][name], value, rtol=1e-9, atol=1e-13)


# ---- tensor and expert tensor parallelism: each group's scale over the weight's shards --------------------------
# a dense SwiGLU layer (fused [gate | up] fc1) and a MoE one; 16 groups straddle the shards' blocks: qkv's groups are
# 6 rows, a column-parallel rank's blocks 16; a row-parallel rank holds half of each of proj's 2-row groups
QAT_TP = ["--qat-weight-bits", "4", "--qat-groups", "16", "--qat-modules", "attention,mlp,experts,router,embedding"]
ASYMMETRIC_STOCHASTIC = ["--no-qat-symmetric", "--qat-rounding", "stochastic"]
TP_ARGV = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]]
TP_ARGV += ["--moe-layer-freq", "[0,1]", "--swiglu", "--train-iters", "3", "--fp64", "--zero-stage", "1"]
TP_ARGV += ["--make-vocab-size-divisible-by", "256"]  # one vocabulary at tp 1 and 2 (padded to this x tp)
TP_LAYOUTS = {
    "tp 2 sp, ep 2 folded, etp 1": (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
        + ["--expert-tensor-parallel-size", "1"]
    ),
    "tp 2 sp, etp 2 (tp's)": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "tp 1, etp 2": ["--expert-tensor-parallel-size", "2"],
}


def _qat_run(argv, save):
    """(history, quantization error per module group) of a run, its last step saved to `save`."""
    run = pretraining(configs(argv + ["--save", save]))
    run.train()
    errors = run.plugins["qat"].quantization_error()
    run.destroy_groups()
    return run.history, errors


def _tp_runs(argv, tmp):
    return {
        (name, rounding): _qat_run(argv + QAT_TP + extra + layout, f"{tmp}/{rank_dir(name, rounding)}")
        for name, layout in TP_LAYOUTS.items()
        for rounding, extra in (("nearest", []), ("asymmetric stochastic", ASYMMETRIC_STOCHASTIC))
        if rounding == "nearest" or "etp 2" in name
    }


def rank_dir(name, rounding):
    return "".join(c for c in name + rounding if c.isalnum())


def _assert_same_export(ckpt, expected_ckpt):
    """The quantized files exported from two checkpoints: the same codes, scales and other weights."""
    got, expected = (export_quantized(s, s.qat) for s in map(load_checkpoint_model, (ckpt, expected_ckpt)))
    assert got["quantized"].keys() == expected["quantized"].keys() and len(expected["quantized"]) > 0
    for name, entry in expected["quantized"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tol = dict(rtol=0, atol=0) if not value.is_floating_point() else dict(rtol=1e-12, atol=0)
                torch.testing.assert_close(
                    got["quantized"][name][key], value, **tol, msg=lambda m: f"{name}.{key}: {m}"
                )
    for name, value in expected["tensors"].items():
        torch.testing.assert_close(got["tensors"][name], value, rtol=1e-10, atol=1e-13)


def test_qat_at_tensor_and_expert_tensor_parallelism_equals_one_process(tmp_path):
    """tp 2 with sequence parallelism (experts whole over ep 2, or split over etp 2) and tp 1 etp 2, in float64 over
    3 steps: the losses and gradient norms of one process's QAT run, the same quantization errors, and checkpoints
    exporting the same codes and scales (each group's scale from the whole weight's group, on every rank)."""
    argv = TP_ARGV + ["--data-cache-path", str(tmp_path)]
    single = {
        rounding: _qat_run(argv + QAT_TP + extra, str(tmp_path / rank_dir("single", rounding)))
        for rounding, extra in (("nearest", []), ("asymmetric stochastic", ASYMMETRIC_STOCHASTIC))
    }
    plain = train(argv, str(tmp_path))
    assert _worst([h["lm_loss"] for h in single["nearest"][0]], [h["lm_loss"] for h in plain]) > 1e-4
    ranks = run_distributed(_tp_runs, 2, argv, str(tmp_path), timeout=300)
    for (name, rounding), (curve, errors) in ranks[0].items():
        expected_curve, expected_errors = single[rounding]
        assert_same_curve(f"{name}, {rounding}", curve, expected_curve, tol=1e-9)
        assert errors.keys() == expected_errors.keys() and len(errors) == 5, (name, errors)
        for group, error in errors.items():
            assert abs(error - expected_errors[group]) <= 1e-12 * expected_errors[group], (name, group, error)
        _assert_same_export(str(tmp_path / rank_dir(name, rounding)), str(tmp_path / rank_dir("single", rounding)))
    assert ranks[1] == ranks[0]  # every rank logs the same curves and errors
