"""The Megatron drop-in against Megatron's own argument parser: every flag moezero shares with Megatron-LM has
Megatron's default, takes its value the same way, and the widths Megatron derives are derived alike.

The oracle is megatron-core 0.19.2's `megatron/training/arguments.py`, read into
moezero/training/assets/megatron_arguments.json by tools/megatron_arguments.py (the version is recorded there).
"""

import pytest

from moezero.config import ConfigError, MoEConfig
from moezero.recipe import CONFIG_CLASSES
from moezero.training.args import build_parser
from moezero.training.configs import DESCRIPTION
from moezero.training.megatron_flags import megatron_table
from tests.integration.pretrain_utils import TINY, configs

MEGATRON = megatron_table()
SWITCHES = ("storetrue", "storefalse", "booleanoptional")

# Megatron requires a value for these (its default is None); moezero keeps a small one so a bare run works
MEGATRON_REQUIRES = {
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--micro-batch-size",
    "--global-batch-size",
    "--lr",
    "--split",
    "--tokenizer-type",
    "--eval-interval",
    "--save-interval",
    "--exit-interval",
}
# the same numbers either way; moezero's default is its faster implementation
IMPLEMENTATION_CHOICES = {
    "--moe-grouped-gemm": "one grouped GEMM for the local experts, else a loop",
    "--overlap-grad-reduce": "buckets reduced during backward",
    "--ddp-bucket-size": "Megatron derives max(40M, 1M x dp) when unset",
}


def _our_flags():
    """{flag: argparse action} of moezero's parser (the --no-X halves of its switches left out)."""
    parser = build_parser(CONFIG_CLASSES, DESCRIPTION)
    return {
        action.option_strings[0]: action
        for action in parser._actions
        if action.option_strings and action.option_strings[0].startswith("--")
    }


def test_the_oracle_is_megatron_core_0_19():
    assert MEGATRON["megatron_core"].startswith("0.19") and len(MEGATRON["flags"]) > 800


def test_every_shared_flag_has_megatrons_default():
    differences, shared = [], 0
    for flag, action in _our_flags().items():
        theirs = MEGATRON["flags"].get(flag)
        if theirs is None or flag in MEGATRON_REQUIRES or flag in IMPLEMENTATION_CHOICES:
            continue
        shared += 1
        if theirs["action"] in SWITCHES:  # a switch: given, it does something; not given, nothing
            if action.nargs != 0 or action.default not in (False, None):
                differences.append(f"{flag}: a switch in Megatron, here it takes a value or is on by default")
        elif action.nargs == 0:
            differences.append(f"{flag}: takes a value in Megatron, here it is a switch")
        elif action.default != theirs["default"]:
            differences.append(f"{flag}: {action.default!r} here, {theirs['default']!r} in Megatron")
    assert not differences, "\n".join(differences)
    assert shared > 60


def test_derived_defaults_are_megatrons():
    base = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4"]
    cfg = configs(base + ["--swiglu"])
    assert cfg.model.ffn_hidden_size == int(4 * 256 * 2 / 3 / 64) * 64 == 640  # Megatron's SwiGLU width
    assert configs(base).model.ffn_hidden_size == 1024
    assert configs(base).moe.num_experts is None  # no --num-experts: dense
    moe = configs(base + ["--num-experts", "4", "--ffn-hidden-size", "96"])
    assert moe.moe.ffn_hidden_size is None and moe.model.ffn_hidden_size == 96  # experts take the dense width


def _params(argv):
    return _params_of(
        configs(
            [
                "--num-layers",
                "2",
                "--hidden-size",
                "32",
                "--num-attention-heads",
                "2",
                "--seq-length",
                "16",
                "--moe-shared-expert-intermediate-size",
                "8",
            ]
            + argv
        )
    )


def test_linear_layers_have_biases_unless_disabled_experts_and_router_too():
    dense = _params([])
    assert not any("mlp.experts" in n or "router" in n for n in dense)  # no --num-experts: no MoE
    assert "layers.0.attention.qkv.bias" in dense and "layers.0.mlp.fc1.bias" in dense
    moe = _params(["--num-experts", "4"])
    for name in (
        "layers.0.attention.qkv.bias",
        "layers.1.mlp.experts.b1",
        "layers.1.mlp.experts.b2",
        "layers.1.mlp.router.wg.bias",
        "layers.1.mlp.shared_expert.fc1.bias",
    ):
        assert name in moe, name
    assert moe["layers.1.mlp.experts.b1"] == (4, 128)
    bare = _params(["--num-experts", "4", "--disable-bias-linear"])
    assert not [n for n in bare if n.endswith(("bias", ".b1", ".b2")) and "norm" not in n], bare
    assert MoEConfig().bias is None  # an MoE layer built alone (MoELayer(MoEConfig(...))) has none


def test_a_checkpoint_from_before_disable_bias_linear_resumes_as_its_model():
    """Its stored configs lack the field; they describe attention and MLPs with biases and MoE layers without,
    which --use-checkpoint-args rebuilds."""
    import dataclasses

    from moezero.config import upgrade_stored_configs
    from moezero.training.resume import ResumePoint, apply_checkpoint_args

    cfg = configs(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--num-experts", "4"])
    stored = {section: dataclasses.asdict(getattr(cfg, section)) for section in ("model", "moe")}
    del stored["model"]["disable_bias_linear"], stored["moe"]["bias"]
    resumed = apply_checkpoint_args(cfg, ResumePoint("ckpt", 3, upgrade_stored_configs(stored), {}), lambda _: None)
    names = set(_params_of(resumed))
    assert "layers.0.attention.qkv.bias" in names and "layers.0.mlp.fc1.bias" not in names
    assert not any(n.endswith((".b1", ".b2", "wg.bias")) for n in names), names


def test_checkpoint_args_take_the_sequence_length_and_dropouts_as_megatron_does():
    """Megatron's load_args_from_checkpoint takes them from its own checkpoints too; here where the command line
    does not set them."""
    import dataclasses

    from moezero.training.resume import ResumePoint, apply_checkpoint_args

    shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2"]
    saved = configs(
        shape
        + [
            "--seq-length",
            "1024",
            "--max-position-embeddings",
            "4096",
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
        ]
    )
    stored = {section: dataclasses.asdict(getattr(saved, section)) for section in ("model", "moe")}
    point = ResumePoint("ckpt", 3, stored, {})
    reported = []
    resumed = apply_checkpoint_args(configs(shape), point, reported.append).model
    assert (resumed.seq_length, resumed.hidden_dropout, resumed.attention_dropout) == (1024, 0.0, 0.0)
    assert reported == []  # --seq-length was not typed: 256 is the default, not the command line's (issue 71)
    typed = apply_checkpoint_args(configs(shape + ["--seq-length", "512"]), point, lambda _: None).model
    assert typed.seq_length == 512 and typed.max_position_embeddings == 4096


def _params_of(cfg):
    from moezero.parallel import ParallelGroups
    from moezero.training.builders import build_model

    return {name: tuple(p.shape) for name, p in build_model(cfg, ParallelGroups.single(), 100).named_parameters()}


def test_a_shared_expert_with_biases_is_refused_as_megatron_refuses_it():
    """megatron-core's SharedExpertMLP asserts add_bias_linear is False (the routed experts and the router may
    have biases): a command line with a shared expert and without --disable-bias-linear fails there at build."""
    from moezero.training.configs import validate

    shared = TINY + ["--moe-shared-expert-intermediate-size", "16"]
    with pytest.raises(
        ConfigError,
        match="--moe-shared-expert-intermediate-size=16: Megatron's shared experts have "
        "no biases .* give --disable-bias-linear",
    ):
        validate(configs(shared), world_size=1)
    validate(configs(shared + ["--disable-bias-linear"]), world_size=1)
    validate(configs(shared), world_size=1, new_model=False)  # a checkpoint saved before the refusal resumes
