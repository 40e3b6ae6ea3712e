"""The forms Megatron's launch scripts pass, read as Megatron reads them: multi-word values (every nargs of a flag
both parsers have is Megatron's), values Megatron accepts, and flags that change nothing here. The oracles are
Megatron's parser table (tools/megatron_arguments.py) and megatron-core's get_blend_from_list."""

import pytest

from moezero.config import ConfigError
from moezero.data import parse_data_path
from moezero.recipe import CONFIG_CLASSES
from moezero.training.args import build_parser
from moezero.training.configs import DESCRIPTION
from moezero.training.megatron_flags import megatron_table
from tests.integration.pretrain_utils import TINY, configs, train

MEGATRON = megatron_table()["flags"]


def test_every_shared_flag_takes_as_many_values_as_megatrons():
    ours = {a.option_strings[0]: a for a in build_parser(CONFIG_CLASSES, DESCRIPTION)._actions if a.option_strings}
    differences = [
        f"{flag}: nargs {action.nargs!r} here, {MEGATRON[flag]['nargs']!r} in Megatron"
        for flag, action in ours.items()
        if flag in MEGATRON
        and action.nargs != 0
        and MEGATRON[flag]["action"] == "store"
        and action.nargs != MEGATRON[flag]["nargs"]
    ]
    assert not differences, "\n".join(differences)
    assert ours["--data-path"].nargs == "*"


@pytest.mark.parametrize(
    "words",
    [
        ["0.7", "a_text_document", "0.3", "b_text_document"],
        ["a_text_document", "b_text_document"],
        ["a_text_document"],
        ["30", "a", "70", "b", "c"],
    ],
)
def test_data_path_blends_are_megatrons(words):
    utils = pytest.importorskip("megatron.core.datasets.utils")
    data = configs(["--data-path", *words]).data
    prefixes, weights = utils.get_blend_from_list(words)
    if any(_is_number(w) for w in words) and weights is None:  # Megatron would read a number as a prefix
        with pytest.raises(Exception, match="give either prefixes only, or a weight before every prefix"):
            parse_data_path(data.data_path)
        return
    blend = parse_data_path(data.data_path)
    assert list(blend.prefixes) == prefixes and (None if blend.weights is None else list(blend.weights)) == weights


def test_a_quoted_blend_is_the_same_blend():
    assert parse_data_path(configs(["--data-path", "0.7 a 0.3 b"]).data.data_path) == parse_data_path(
        configs(["--data-path", "0.7", "a", "0.3", "b"]).data.data_path
    )


def test_a_data_path_without_words_is_refused():
    with pytest.raises(ConfigError, match=r"--data-path=\[\]: no dataset prefix given"):
        configs(["--data-path"])


def _is_number(word):
    try:
        float(word)
        return True
    except ValueError:
        return False


def test_load_balancing_lists_of_one_are_that_one():
    one = configs(
        ["--num-experts", "4", "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2"]
    ).moe
    assert (one.load_balancing_type, one.aux_loss_coeff) == ("seq_aux_loss", 1e-2)  # Megatron's validate_args
    with pytest.raises(ConfigError, match="--moe-aux-loss-coeff=.*one --moe-aux-loss-coeff per"):
        configs(["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2"])


def test_values_megatron_accepts_are_accepted_with_its_meaning(tmp_path, capsys):
    """GPT-OSS's 02_train.sh: --no-load-optim --no-load-rng on a first run; --eval-iters 0: no evaluation (valid
    nor test: Megatron's do_valid / do_test), even with an --eval-interval and a test split."""
    flags = TINY + [
        "--train-iters",
        "4",
        "--eval-iters",
        "0",
        "--eval-interval",
        "2",
        "--split",
        "80,10,10",
        "--no-load-optim",
        "--no-load-rng",
    ]
    history = train(flags, str(tmp_path))
    assert len(history) == 4 and not any("validation_loss" in h or "test_loss" in h for h in history)
    assert "validation loss" not in capsys.readouterr().out


def test_flags_that_change_nothing_here_are_accepted():
    cfg = configs(
        [
            "--logging-level",
            "20",
            "--empty-unused-memory-level",
            "2",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "100",
            "--tiktoken-pattern",
            "v2",
            "--grad-reduce-in-bf16",
        ]
    )
    assert cfg.zero.grad_reduce_dtype == "bf16"  # --grad-reduce-in-bf16 is --grad-reduce-dtype bf16
    with pytest.raises(ConfigError, match="--grad-reduce-in-bf16"):
        configs(["--grad-reduce-in-bf16", "--grad-reduce-dtype", "fp64"])
