"""Run the pretraining script in-process (inside a test rank, or the test process itself)."""

import contextlib
import io
import os

from moezero.recipe import CONFIG_CLASSES, RecipeConfigs, pretraining
from moezero.training.args import build_parser, configs_from_args, given_dests
from moezero.training.configs import DESCRIPTION
from tests.dist_utils import assert_replicas_equal

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
CORPUS = os.path.join(ASSETS, "corpus", "corpus_text_document")

# a tiny model on the committed corpus, with every source of randomness switched on
TINY = [
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
    "8",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-layer-freq",
    "1",
    "--lr",
    "3e-3",
    "--min-lr",
    "3e-4",
    "--lr-warmup-iters",
    "3",
    "--hidden-dropout",
    "0.1",
    "--attention-dropout",
    "0.1",
    "--moe-input-jitter-eps",
    "0.01",
    "--moe-z-loss-coeff",
    "1e-3",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-expert-capacity-factor",
    "1.5",
    "--adam-beta2",
    "0.95",
    "--lr-decay-style",
    "cosine",
    "--lr-decay-iters",
    "10",
    "--log-interval",
    "1000",
    "--eval-interval",
    "0",
    "--data-path",
    CORPUS,
    "--split",
    "98,2,0",
    "--seed",
    "7",
    "--num-workers",
    "0",
]
# TINY counting samples (Megatron refuses the *-iters schedule flags in a --train-samples run)
TINY_SAMPLES = [
    a
    for i, a in enumerate(TINY)
    if "--lr-decay-iters" not in TINY[max(i - 1, 0) : i + 1] and "--lr-warmup-iters" not in TINY[max(i - 1, 0) : i + 1]
]


def configs(argv):
    """The configs of a command line, as the script parses it (a bad value raises ConfigError here)."""
    parser = build_parser(CONFIG_CLASSES, DESCRIPTION)
    built = configs_from_args(parser.parse_args(argv), CONFIG_CLASSES)
    built["checkpoint"].given_fields = tuple(sorted(given_dests(parser, argv)))
    return RecipeConfigs(**built)


def train(argv, cache_dir):
    """Run a pretraining job; returns its per-iteration history."""
    run = pretraining(configs(argv + ["--data-cache-path", cache_dir]))
    run.train()
    with run.opt.full_parameters():
        assert_replicas_equal(run.model, run.groups)  # dense params and buffers bitwise equal on every rank
    run.groups.destroy()
    return run.history


def run_in_process(argv):
    """(history, console output) of one run of the script's entry point in this process (a spawned rank's)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run = pretraining(configs(argv))
        run.train()
    run.destroy_groups()
    return run.history, out.getvalue()


CURVE_KEYS = ("lm_loss", "grad_norm", "validation_loss", "router_aux_loss", "router_z_loss", "mtp_1_loss")


def assert_same_curve(name, curve, expected, tol=1e-10):
    """A run's history against the expected run's: the same iterations, and at each the losses, gradient norm and
    validation loss within `tol` relative (absolute below 1); a metric neither run logs is None in both."""
    assert [h["iteration"] for h in curve] == [h["iteration"] for h in expected], name
    for h, e in zip(curve, expected):
        for key in CURVE_KEYS:
            x, y = h.get(key), e.get(key)
            assert (x is None) == (y is None), (name, h["iteration"], key, x, y)  # logged by both or neither
            assert x is None or abs(x - y) <= tol * max(1.0, abs(y)), (name, h["iteration"], key, x, y)
