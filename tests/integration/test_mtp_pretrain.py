"""Multi-token prediction in a training run (--mtp-num-layers, --mtp-loss-scaling-factor): the lm and MTP loss
curves are layout invariant (one process = 2 ranks at ep 1 and 2, stages 1 and 3, stage 3 with full recompute, a
stage-3 resume), the MTP
loss trains the model, and it is logged as Megatron logs it ('mtp_1 loss' on the console and in TensorBoard);
the MTP depth's MoE layer is counted and logged with the others. The model has GPT-OSS's attention and experts
(Megatron's flags), whose curves are layout invariant too."""

from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, train

# with GPT-OSS's attention sinks, windows on every other layer (the MTP depth's too) and clamped quick GEGLU
ROPE = TINY + [
    "--position-embedding-type",
    "rope",
    "--train-iters",
    "8",
    "--fp64",
    "--softmax-type",
    "learnable",
    "--window-size",
    "8,0",
    "--window-attn-skip-freq",
    "2",
    "--quick-geglu",
    "--glu-linear-offset",
    "1",
    "--activation-func-clamp-value",
    "0.5",
]
MTP = ROPE + ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]


def _curves(history):
    return [(h["lm_loss"], h["mtp_1_loss"]) for h in history]


def _two_rank_runs(cache_dir, save_dir, tb_dir):
    runs = {
        f"ep{ep} stage{stage}": _curves(
            train(MTP + ["--expert-model-parallel-size", str(ep), "--zero-stage", str(stage)], cache_dir)
        )
        for ep, stage in ((1, 1), (2, 3))
    }
    # Megatron recomputes the MTP depth under full uniform recompute: at stage 3 its recompute can be the backward's
    # first event, which must not read as a backward recording a graph (create_graph=True)
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    runs["ep2 stage3 full recompute"] = _curves(
        train(MTP + recompute + ["--expert-model-parallel-size", "2", "--zero-stage", "3"], cache_dir)
    )
    first = train(
        MTP + ["--expert-model-parallel-size", "2", "--zero-stage", "3", "--exit-interval", "4", "--save", save_dir],
        cache_dir,
    )
    second = train(
        MTP
        + [
            "--expert-model-parallel-size",
            "2",
            "--zero-stage",
            "2",
            "--load",
            save_dir,
            "--tensorboard-dir",
            tb_dir,
            "--log-interval",
            "2",
        ],
        cache_dir,
    )
    runs["ep2 stage3 resumed at stage 2"] = _curves(first + second)
    return runs


def test_mtp_curves_are_layout_invariant_and_logged_as_megatron(tmp_path, capsys):
    cache, save, tb = str(tmp_path), str(tmp_path / "ckpt"), str(tmp_path / "tb")
    single = _curves(train(MTP, cache))
    without = [h["lm_loss"] for h in train(ROPE, cache)]
    for name, curve in run_distributed(_two_rank_runs, 2, cache, save, tb, timeout=600)[0].items():
        assert len(curve) == len(single), name
        worst = max(abs(a - b) / abs(b) for pair, ref in zip(curve, single) for a, b in zip(pair, ref))
        assert worst < 1e-10, (name, curve, single)
    assert single[-1][1] < single[0][1] - 0.1, "the MTP loss must fall"
    assert abs(without[3] - single[3][0]) > 1e-6, "the MTP loss's gradient must reach the shared model"
    assert "| mtp_1 loss: " in capsys.readouterr().out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    steps = {e.step: e.value for e in events.Scalars("mtp_1 loss")}
    assert (
        list(steps) == [5, 6, 7, 8] and abs(steps[8] - single[-1][1]) < 1e-6 * single[-1][1]
    )  # TensorBoard keeps fp32
    assert "moe/layer2/tokens-per-expert/3" in events.Tags()["scalars"]  # the MTP depth's MoE layer
