"""--load-hf and --save-hf at --tensor-model-parallel-size 2 and --expert-tensor-parallel-size 2 (the script's entry
point in-process on 2 gloo ranks): each rank reads from the Hub files exactly the elements of its slices (half of
every q/k/v/o, MLP and vocabulary tensor, no whole row of a row-parallel weight; at etp 2 half of each expert's
gate/up rows and down columns) and the replicated tensors whole, the run follows the same run at tp 1 (float64,
1e-10 relative), and the Hub folder it writes is the tp 1 run's, tensor by tensor: a Qwen3 dense model with GQA, a
Qwen3-MoE with --sequence-parallel and etp 1 (ep folded), at Megatron's default etp (2) under ZeRO 3, and at tp 1
etp 2, and a DeepSeek-V3 (multi-latent attention: half of q_b_proj, kv_b_proj and o_proj, the latents' projections
and norms whole) with --sequence-parallel and etp 1."""

import json
import os
import re

import pytest
import torch

from moezero.hf.files import HubDirectory
from tests.dist_utils import run_distributed
from tests.hf_oracle import hub_tensors, tiny_model
from tests.integration.pretrain_utils import run_in_process

# NullTokenizer: 95 ids and its end-of-document, the Hub model's 96 (a vocabulary that splits over 2)
RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "95", "--train-iters", "3"]
RUN += ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3"]
RUN += ["--num-workers", "0", "--eval-iters", "1", "--eval-interval", "100", "--log-interval", "1", "--fp64"]
TP2 = ["--tensor-model-parallel-size", "2"]
LAYOUTS = {  # (family, its layout at 2 ranks)
    "qwen3 tp2": ("qwen3", TP2),
    "qwen3_moe tp2 sp etp1": ("qwen3_moe", TP2 + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"]),
    # Megatron's default etp (tp); ZeRO 3: the tensors written come unit by unit through the optimizer
    "qwen3_moe tp2 sp etp2 zero3": ("qwen3_moe", TP2 + ["--sequence-parallel", "--zero-stage", "3"]),
    "qwen3_moe tp1 etp2": ("qwen3_moe", ["--expert-tensor-parallel-size", "2"]),
    "deepseek_v3 tp2 sp etp1": ("deepseek_v3", TP2 + ["--sequence-parallel", "--expert-tensor-parallel-size", "1"]),
}
# the Hub tensors a tp rank holds half of: attention's, the dense MLPs', the vocabulary's (experts and router whole)
TP_SPLIT = r"self_attn\.([qkvo]|q_b|kv_b)_proj|\.mlp\.(gate|up|down)_proj|embed_tokens|lm_head"
ETP_SPLIT = r"\.experts\.\d+\.(gate|up|down)_proj"  # an etp rank's: half of each expert's
TOL = 1e-10


class _CountedSlice:
    """A safetensors slice that adds the elements each read of it returns to counts[key]."""

    def __init__(self, piece, key, counts):
        self.piece, self.key, self.counts = piece, key, counts

    def __getitem__(self, index):
        value = self.piece[index]
        self.counts[self.key] = self.counts.get(self.key, 0) + value.numel()
        return value

    def __getattr__(self, name):  # get_shape, get_dtype
        return getattr(self.piece, name)


def _counting_elements(counts):
    """Patch HubDirectory's access to the safetensors files to add the elements each read takes out of them to
    counts[key]; returns the undo."""
    stored, sliced = HubDirectory._stored, HubDirectory._slice

    def counted_stored(self, key):
        value = stored(self, key)
        counts[key] = counts.get(key, 0) + value.numel()
        return value

    HubDirectory._stored = counted_stored
    HubDirectory._slice = lambda self, key: _CountedSlice(sliced(self, key), key, counts)

    def undo():
        HubDirectory._stored, HubDirectory._slice = stored, sliced

    return undo


def _load_at_tp2(argv):
    """(the history, the elements read per Hub tensor) of the run at tp 2 on this rank."""
    counts = {}
    undo = _counting_elements(counts)
    try:
        history, _ = run_in_process(argv)
    finally:
        undo()
    return history, counts


def _run_at_tp2_pp2(argv):
    return run_in_process(argv)[0]


def test_save_hf_at_tp2_x_pp2_writes_the_tp1_pp1_folder(tmp_path):
    """A Qwen3-MoE (2 layers, tied embeddings) at tp 2 (sequence parallel, etp 2) x pp 2 on 4 ranks: each stage's tp
    and etp groups gather its tensors, and the folder is a tp 1 pp 1 run's, tensor by tensor."""
    hub = str(tmp_path / "hub")
    tiny_model("qwen3_moe", seed=3, vocab_size=96, num_hidden_layers=2).save_pretrained(hub)
    argv = RUN + ["--load-hf", hub, "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "1"]
    single, _ = run_in_process(argv + ["--save-hf", str(tmp_path / "tp1")])
    layout = TP2 + ["--sequence-parallel", "--pipeline-model-parallel-size", "2"]
    ranks = run_distributed(_run_at_tp2_pp2, 4, argv + layout + ["--save-hf", str(tmp_path / "tp2pp2")], timeout=300)
    for curve in ranks:
        assert abs(curve[0]["lm_loss"] - single[0]["lm_loss"]) <= TOL * abs(single[0]["lm_loss"]), (curve, single)
    _assert_same_hub_folder(str(tmp_path / "tp2pp2" / "iter_0000001"), str(tmp_path / "tp1" / "iter_0000001"), 4)


def _split(layout):
    """The Hub tensors each rank of `layout` holds half of."""
    tp = "--tensor-model-parallel-size" in layout
    etp = (
        "--expert-tensor-parallel-size" not in layout
        or layout[layout.index("--expert-tensor-parallel-size") + 1] != "1"
    )
    return re.compile("|".join(([TP_SPLIT] if tp else []) + ([ETP_SPLIT] if etp else [])))


@pytest.mark.parametrize("case", LAYOUTS)
def test_hf_at_tp2_etp2_reads_each_ranks_slices_trains_and_writes_as_tp1(tmp_path, case):
    family, layout = LAYOUTS[case]
    hub = str(tmp_path / "hub")
    tiny_model(family, seed=3, vocab_size=96).save_pretrained(hub)  # 4 heads, 2 query groups (GQA), float64
    argv = RUN + ["--load-hf", hub, "--data-cache-path", str(tmp_path / "cache")]
    single, _ = run_in_process(argv + ["--save-hf", str(tmp_path / "tp1")])
    ranks = run_distributed(_load_at_tp2, 2, argv + layout + ["--save-hf", str(tmp_path / "tp2")], timeout=300)
    tensors = hub_tensors(hub)
    SPLIT = _split(layout)
    assert any(SPLIT.search(key) for key in tensors) and any(not SPLIT.search(key) for key in tensors)
    for curve, counts in ranks:
        assert len(curve) == len(single) == 3
        for got, want in zip(curve, single):
            for name in ("lm_loss", "grad_norm"):
                assert abs(got[name] - want[name]) <= TOL * abs(want[name]), (family, name, got, want)
        # exactly its slices: half of a split tensor (a row-parallel weight's columns, not whole rows), else whole
        expected = {key: value.numel() // (2 if SPLIT.search(key) else 1) for key, value in tensors.items()}
        assert counts == expected, {k: (counts.get(k), n) for k, n in expected.items() if counts.get(k) != n}
    _assert_same_hub_folder(str(tmp_path / "tp2" / "iter_0000003"), str(tmp_path / "tp1" / "iter_0000003"))


def _assert_same_hub_folder(got, want, writers=2):
    """The folder a run at tp 2 wrote against the tp 1 run's: the same config and keys, each tensor of the same
    shape and dtype and within the runs' agreement (the fused q/k/v and gate/up parts each in its place); the
    files are the `writers` ranks' (each writes its share), the tp 1 run's its one."""
    with open(os.path.join(got, "config.json")) as f, open(os.path.join(want, "config.json")) as g:
        assert json.load(f) == json.load(g)
    mine, theirs = hub_tensors(got), hub_tensors(want)
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        assert mine[key].shape == value.shape and mine[key].dtype == value.dtype, key
        scale = value.abs().max().item()
        assert (mine[key] - value).abs().max().item() <= TOL * max(scale, 1.0), key
    index = HubDirectory(got).weight_map
    assert sorted(set(index.values())) == [f"model-{k:05d}-of-{writers:05d}.safetensors" for k in range(1, writers + 1)]


def test_hf_flags_at_tp2_and_etp2_are_no_refusal(tmp_path):
    """--load-hf and --save-hf run at tp 2 and at etp 2 (Megatron's default at tp 2, and at tp 1), with pipeline
    stages too."""
    from moezero.training.tensor_parallel_checks import tensor_parallel_refusals
    from tests.integration.pretrain_utils import configs

    moe = ["--num-experts", "4", "--moe-expert-capacity-factor", "-1"]
    hf = ["--load-hf", str(tmp_path), "--save-hf", str(tmp_path / "out")]
    for layout in (TP2, TP2 + ["--sequence-parallel"] + moe, ["--expert-tensor-parallel-size", "2"] + moe):
        assert tensor_parallel_refusals(configs(RUN + layout + hf), world_size=2) == [], layout
    assert tensor_parallel_refusals(configs(RUN + TP2 + ["--pipeline-model-parallel-size", "2"] + hf), 4) == []


# a dense Llama from scratch: its vocabulary is the tokenizer's 96 padded to 128 at tp 1, 256 at tp 2
LLAMA = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--ffn-hidden-size", "32"]
LLAMA += ["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
LLAMA += ["--untie-embeddings-and-output-weights", "--max-position-embeddings", "16"]


def _train_at_tp2(argv):
    run_in_process(argv)


def test_save_hf_at_tp2_leaves_out_the_vocabulary_rows_tp_pads(tmp_path):
    """--save-hf of a run from scratch at tp 2 writes the vocabulary a tp 1 run pads to (128 rows), not tp 2's
    (256), and tools/hf_checkpoint.py export of the run's checkpoint writes that folder: the same tensors
    (within fp32's rounding: the checkpoint holds fp32 masters of the float64 params) and config, and so does the
    run resumed from it at tp 1; a checkpoint of an older moezero (no vocabulary recorded) keeps all 256 rows, and
    the tool says so."""
    from moezero.hf.checkpoint_conversion import exported_vocab_size
    from moezero.checkpoint import read_train_state, resolve_checkpoint
    from tools.hf_checkpoint import main as hf_checkpoint

    ckpt, saved, exported = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "exported")
    argv = (
        RUN
        + LLAMA
        + TP2
        + ["--train-iters", "1", "--save", ckpt, "--save-hf", saved, "--data-cache-path", str(tmp_path / "cache")]
    )
    run_distributed(_train_at_tp2, 2, argv, timeout=300)
    assert hf_checkpoint(["export", ckpt, exported]) == 0
    saved = os.path.join(saved, "iter_0000001")
    got, want = hub_tensors(exported), hub_tensors(saved)
    assert sorted(got) == sorted(want)
    assert got["model.embed_tokens.weight"].shape[0] == got["lm_head.weight"].shape[0] == 128
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=0, msg=key)  # fp32 masters of float64 params
    with open(os.path.join(saved, "config.json")) as f, open(os.path.join(exported, "config.json")) as g:
        assert json.load(g) == json.load(f)
    # resumed at tp 1 (its 256 rows fit --make-vocab-size-divisible-by 256): --save-hf still writes the 128 rows
    resumed = str(tmp_path / "resumed")
    run_in_process(
        RUN
        + LLAMA
        + ["--train-iters", "2", "--load", ckpt, "--override-opt_param-scheduler", "--save-hf", resumed]
        + ["--make-vocab-size-divisible-by", "256", "--data-cache-path", str(tmp_path / "cache")]
    )
    resumed_tensors = hub_tensors(os.path.join(resumed, "iter_0000002"))
    assert resumed_tensors["model.embed_tokens.weight"].shape[0] == resumed_tensors["lm_head.weight"].shape[0] == 128
    # what an older moezero's checkpoint exports: all its rows, with one notice
    configs = dict(read_train_state(resolve_checkpoint(ckpt))["configs"])
    assert configs.pop("vocabulary") == {"tokenizer": 96, "exported": 128}
    notices = []
    assert exported_vocab_size(configs, 256, notices.append) is None
    assert len(notices) == 1 and "all 256 rows" in notices[0] and "--tensor-model-parallel-size 2" in notices[0]
