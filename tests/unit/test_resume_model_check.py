"""A resume refuses a checkpoint of another model: a flag whose unset value is a setting of its own (no shared
expert, no window, no MTP) compared like any value, and weights in the checkpoint that the model lacks; a value
the code derives when unset (--ffn-hidden-size) and a field the checkpoint predates are not compared."""

import dataclasses

import pytest
import torch

from moezero.checkpoint import CheckpointError
from moezero.models import GPTModel
from moezero.config import ConfigError
from moezero.training.resume import ResumePoint, adopted_vocabulary, check_same_model, check_shapes
from tests.integration.pretrain_utils import TINY, configs

ROPE = ["--position-embedding-type", "rope"]
# flags whose absence is a model of its own: (flags, the flag the error names)
OFF_WHEN_UNSET = [
    (["--moe-shared-expert-intermediate-size", "32"], "--moe-shared-expert-intermediate-size"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers"),
    (["--window-size", "4,0"], "--window-size"),
    (["--moe-router-topk-scaling-factor", "2.5"], "--moe-router-topk-scaling-factor"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], "--moe-router-num-groups"),
    (["--swiglu", "--activation-func-clamp-value", "7"], "--activation-func-clamp-value"),
]


def _stored(cfg):
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in ("model", "moe")}


def _check(saved_argv, now_argv):
    saved, now = configs(TINY + ROPE + saved_argv), configs(TINY + ROPE + now_argv)
    check_same_model(now, ResumePoint("ckpt", 3, _stored(saved), {}))


@pytest.mark.parametrize("flags,named", OFF_WHEN_UNSET, ids=[named for _, named in OFF_WHEN_UNSET])
def test_a_setting_the_checkpoint_has_not_or_had_is_another_model(flags, named):
    base = ["--swiglu"] if "--swiglu" in flags else []
    with pytest.raises(CheckpointError, match=f"{named}: unset in the checkpoint, .* now"):
        _check(base, flags)
    with pytest.raises(CheckpointError, match=f"{named}: .* in the checkpoint, unset now"):
        _check(flags, base)
    _check(flags, flags)


def test_what_the_code_derives_when_unset_and_fields_a_checkpoint_predates_are_not_compared():
    _check([], ["--ffn-hidden-size", "128", "--kv-channels", "16"])  # TINY's derived values, given now
    saved, now = configs(TINY + ROPE), configs(TINY + ROPE + ["--window-size", "4,0"])
    stored = _stored(saved)
    del stored["model"]["window_size"]  # a checkpoint from before the flag existed
    check_same_model(now, ResumePoint("ckpt", 3, stored, {}))


def test_weights_the_checkpoint_has_and_the_model_lacks_are_refused():
    cfg = configs(TINY)
    model = GPTModel(dataclasses.replace(cfg.model, vocab_size=64), cfg.moe, seed=1)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_shapes(model, ResumePoint("ckpt", 3, {}, shapes))
    extra = dict(shapes, **{"layers.0.mlp.shared_expert.fc1.weight": (64, 32)})
    with pytest.raises(CheckpointError, match="layers.0.mlp.shared_expert.fc1.weight is in it, not in this model"):
        check_shapes(model, ResumePoint("ckpt", 3, {}, extra))


def test_a_requeued_upcycling_run_resumes_its_own_checkpoint(tmp_path):
    """The same --moe-use-upcycling command run again once the MoE run saved (a requeued job) resumes the run's
    own checkpoint in --save; upcycling the dense --load again would start at 0 and overwrite its saves."""
    from moezero.recipe import pretraining
    from moezero.training.run_start import resolve_start
    from tests.integration.pretrain_utils import CORPUS

    dense, moe, cache = str(tmp_path / "dense"), str(tmp_path / "moe"), str(tmp_path / "cache")
    base = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "2",
        "--train-iters",
        "2",
        "--data-path",
        CORPUS,
        "--split",
        "98,2,0",
        "--num-workers",
        "0",
        "--eval-interval",
        "0",
        "--data-cache-path",
        cache,
    ]
    for argv in (
        base + ["--save", dense],
        base + ["--load", dense, "--save", moe, "--moe-use-upcycling", "--num-experts", "4", "--moe-router-topk", "2"],
    ):
        run = pretraining(configs(argv))
        run.train()
        run.groups.destroy()
    start = resolve_start(configs(argv))
    assert start.point is not None and start.point.path.startswith(moe) and start.point.iteration == 2
    assert start.dense_source is None
    assert any("resuming from the run's own checkpoint" in line for line in start.notices)
    same = argv[: argv.index("--save")] + ["--save", dense] + argv[argv.index("--save") + 2 :]  # --save is --load
    start = resolve_start(configs(same))
    assert start.dense_source is not None and start.point is None  # a first run there upcycles


def test_an_mla_checkpoint_with_down_projection_biases_is_named_as_such():
    """Checkpoints of MLA runs without --disable-bias-linear from before moezero built MLA as megatron-core does
    hold q_down/kv_down biases: resuming says so, and the tools refuse the weights they have no place for
    instead of running the model without them."""
    from moezero.compression.description import ModelDescription
    from moezero.compression.inference import load_checkpoint_weights
    from moezero.compression.source import CheckpointModel
    from moezero.config import ConfigError

    cfg = configs(
        TINY[: TINY.index("--num-experts")]
        + [
            "--multi-latent-attention",
            "--q-lora-rank",
            "8",
            "--kv-lora-rank",
            "8",
            "--qk-head-dim",
            "8",
            "--qk-pos-emb-head-dim",
            "4",
            "--v-head-dim",
            "8",
            "--position-embedding-type",
            "rope",
        ]
    )
    gpt = dataclasses.replace(cfg.model, vocab_size=64)
    model = GPTModel(gpt, None, seed=1)
    old = {name: tuple(p.shape) for name, p in model.named_parameters()}
    old["layers.0.attention.q_down.bias"] = (8,)
    with pytest.raises(CheckpointError, match="its MLA down projections have biases: it was trained before"):
        check_shapes(model, ResumePoint("ckpt", 3, {}, old))
    state = dict(model.state_dict(), **{"layers.0.attention.q_down.bias": torch.zeros(8)})
    source = CheckpointModel("old", state, ModelDescription.from_configs(gpt, None, torch.float32), None, None, 3)
    with pytest.raises(
        ConfigError, match="old: holds weights this model has no place for \\(layers.0.attention.q_down.bias\\)"
    ):
        load_checkpoint_weights(source)
    load_checkpoint_weights(dataclasses.replace(source, state=model.state_dict()))


def _saved_at(rows: int, tp: int, divisor: int = 128) -> ResumePoint:
    """A checkpoint of `rows` padded vocabulary rows, saved at tp `tp` (its embedding's global shape)."""
    configs = {"model": {"make_vocab_size_divisible_by": divisor}, "parallel": {"tensor_parallel_size": tp}}
    shapes = {"embedding.weight": (rows, 16), "output_layer.weight": (rows, 16)}
    return ResumePoint("ckpt/iter_0000002", 2, configs, shapes)


def test_a_checkpoint_padded_at_another_tp_gives_its_vocabulary_or_one_line_why_not():
    """Vocabulary 95: 128 rows at tp 1, 256 at tp 2 (Megatron's padding). The checkpoint's rows are adopted where
    they split over this tp; rows that do not, or fewer than the tokenizer's, are refused in one line."""
    assert adopted_vocabulary(_saved_at(256, 2), 95, 128, 1) == 256  # saved at tp 2, resumed at tp 1
    assert adopted_vocabulary(_saved_at(128, 1), 95, 256, 2) == 128  # and the reverse
    assert adopted_vocabulary(_saved_at(128, 1), 95, 128, 1) is None  # the run's own padding
    with pytest.raises(ConfigError) as refused:
        adopted_vocabulary(_saved_at(95, 1, divisor=1), 95, 256, 2)  # saved unpadded
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "--load: the padded vocabulary of ckpt/iter_0000002 (95 rows: the tokenizer's 95 padded to a multiple of "
        "--make-vocab-size-divisible-by 1 x tp 1) does not split over --tensor-model-parallel-size 2; resume at a "
        "tp that divides 95"
    )
    with pytest.raises(ConfigError, match=r"^--load: ckpt/iter_0000002 has a vocabulary of 128 rows, fewer than "):
        adopted_vocabulary(_saved_at(128, 1), 200, 256, 2)
