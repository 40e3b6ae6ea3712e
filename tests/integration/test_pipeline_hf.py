"""--save-hf and --load-hf at --pipeline-model-parallel-size 2 (the script's entry point in-process on 2 gloo ranks):
each rank writes and reads only its own stages' tensors, no rank holding the whole model. The folder a pp 2 run
writes is the one a run in one process writes of the same weights (same tensors bit for bit, same config), and
a run started from it at pp 2 follows the same run in one process (float64, 1e-10 relative)."""

import json
import os
import re
import shutil

from moezero.hf.files import HubDirectory
from tests.dist_utils import run_distributed
from tests.hf_oracle import hub_tensors
from tests.integration.pretrain_utils import run_in_process
from tests.integration.test_pipeline_pretrain import PIPELINE_TINY, PP2, TOL

# PIPELINE_TINY (its flags given again: the last wins) as a Qwen3-MoE, tied embedding and output weights and a dense
# first layer: a family that holds it
QWEN3_MOE = PIPELINE_TINY + [
    "--eval-interval",
    "0",
    "--train-iters",
    "2",
    "--swiglu",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--qk-layernorm",
]
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _counting_reads(read_keys):
    """Patch HubDirectory's readers to add each key read to `read_keys`; returns the undo."""
    read, read_rows = HubDirectory.read, HubDirectory.read_rows

    def counted_read(self, key):
        read_keys.add(key)
        return read(self, key)

    def counted_rows(self, key, start, stop):
        read_keys.add(key)
        return read_rows(self, key, start, stop)

    HubDirectory.read, HubDirectory.read_rows = counted_read, counted_rows

    def undo():
        HubDirectory.read, HubDirectory.read_rows = read, read_rows

    return undo


def _save_at_pp2(argv, saved, hub):
    """At pp 2: 2 iterations, saved as a checkpoint and a Hub folder."""
    run_in_process(argv + PP2 + ["--save", saved, "--save-hf", hub])


def _load_at_pp2(argv, folder):
    """At pp 2: 2 iterations from the Hub folder. (the history, the Hub tensors this rank read)"""
    keys = set()
    undo = _counting_reads(keys)
    try:
        history, _ = run_in_process(argv + PP2 + ["--load-hf", folder])
    finally:
        undo()
    return history, keys


def test_save_hf_and_load_hf_at_pp2_are_pp1s(tmp_path):
    argv = QWEN3_MOE + ["--data-cache-path", str(tmp_path / "cache")]
    saved, hub, at_pp1 = str(tmp_path / "ckpt"), str(tmp_path / "hub"), str(tmp_path / "at_pp1")
    folder = os.path.join(hub, "iter_0000002")
    run_distributed(_save_at_pp2, 2, argv, saved, hub, timeout=400)

    # the Hub folder the stages wrote = the one a run in one process writes of the same weights: the pp 2 run's
    # checkpoint resumed at its last iteration (nothing to train, the end of the run: its --save-hf)
    run_in_process(argv + ["--load", saved, "--save-hf", at_pp1])
    written, expected = hub_tensors(folder), hub_tensors(os.path.join(at_pp1, "iter_0000002"))
    assert sorted(written) == sorted(expected) and "lm_head.weight" not in written  # tied: the embedding only
    for key, value in expected.items():
        assert written[key].dtype == value.dtype and written[key].equal(value), key
    with open(os.path.join(folder, "config.json")) as f, open(os.path.join(at_pp1, "iter_0000002", "config.json")) as g:
        assert json.load(f) == json.load(g)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    first_stage = {key for key, name in weight_map.items() if name == weight_map["model.embed_tokens.weight"]}
    assert {int(m.group(1)) for key in first_stage if (m := LAYER.match(key))} == {0, 1}, "rank 0 writes stage 0"
    assert len(set(weight_map.values())) == 2, "one file per stage"

    # from the folder (its weights: the tokenizer written is the corpus's byte-level one in the Hub's form, which
    # the corpus's tokenizer record would refuse): each rank reads its stages' tensors only, on one process's curve
    weights = str(tmp_path / "weights")
    shutil.copytree(folder, weights, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    (_, first_read), (curve, last_read) = run_distributed(_load_at_pp2, 2, argv, weights, timeout=400)
    assert first_read | last_read == set(written) and not first_read & last_read
    assert {int(m.group(1)) for key in first_read if (m := LAYER.match(key))} == {0, 1}
    assert {int(m.group(1)) for key in last_read if (m := LAYER.match(key))} == {2, 3}
    assert "model.embed_tokens.weight" in first_read and "model.norm.weight" in last_read
    single, _ = run_in_process(argv + ["--load-hf", weights])
    assert len(curve) == len(single) == 2
    for got, want in zip(curve, single):
        for name in ("lm_loss", "grad_norm"):
            assert abs(got[name] - want[name]) <= TOL * abs(want[name]), (name, got, want)
