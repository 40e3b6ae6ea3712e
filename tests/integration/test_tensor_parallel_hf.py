"""--load-hf at --tensor-model-parallel-size 2 (the script's entry point in-process on 2 gloo ranks): each rank reads
from the Hub files exactly the elements of its slices (half of every q/k/v/o, MLP and vocabulary tensor, no whole
row of a row-parallel weight) and the replicated tensors whole, and the run follows the same run at tp 1 (float64,
1e-10 relative): a Qwen3 dense model with GQA, a Qwen3-MoE with --sequence-parallel and etp 1, and a DeepSeek-V3
(multi-latent attention: half of q_b_proj, kv_b_proj and o_proj, the latents' projections and norms whole) with
--sequence-parallel and etp 1."""

import re

import pytest

from moezero.hf.files import HubDirectory
from tests.dist_utils import run_distributed
from tests.hf_oracle import hub_tensors, tiny_model
from tests.integration.pretrain_utils import run_in_process

# NullTokenizer: 95 ids and its end-of-document, the Hub model's 96 (a vocabulary that splits over 2)
RUN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "95", "--train-iters", "3"]
RUN += ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3"]
RUN += ["--num-workers", "0", "--eval-iters", "1", "--eval-interval", "100", "--log-interval", "1", "--fp64"]
TP2 = {
    "qwen3": ["--tensor-model-parallel-size", "2"],
    "qwen3_moe": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"],
}
TP2["deepseek_v3"] = TP2["qwen3_moe"]
# the Hub tensors a tp rank holds half of: attention's, the dense MLPs', the vocabulary's (experts and router whole)
SPLIT = re.compile(r"self_attn\.([qkvo]|q_b|kv_b)_proj|\.mlp\.(gate|up|down)_proj|embed_tokens|lm_head")
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


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_load_hf_at_tp2_reads_each_ranks_slices_and_trains_as_tp1(tmp_path, family):
    hub = str(tmp_path / "hub")
    tiny_model(family, seed=3, vocab_size=96).save_pretrained(hub)  # 4 heads, 2 query groups (GQA), float64
    argv = RUN + ["--load-hf", hub, "--data-cache-path", str(tmp_path / "cache")]
    single, _ = run_in_process(argv)
    ranks = run_distributed(_load_at_tp2, 2, argv + TP2[family], timeout=300)
    tensors = hub_tensors(hub)
    assert any(SPLIT.search(key) for key in tensors) and any(not SPLIT.search(key) for key in tensors)
    for curve, counts in ranks:
        assert len(curve) == len(single) == 3
        for got, want in zip(curve, single):
            for name in ("lm_loss", "grad_norm"):
                assert abs(got[name] - want[name]) <= TOL * abs(want[name]), (family, name, got, want)
        # exactly its slices: half of a split tensor (a row-parallel weight's columns, not whole rows), else whole
        expected = {key: value.numel() // (2 if SPLIT.search(key) else 1) for key, value in tensors.items()}
        assert counts == expected, {k: (counts.get(k), n) for k, n in expected.items() if counts.get(k) != n}


def test_save_hf_at_tp2_is_one_line_naming_the_export(tmp_path):
    """--load-hf runs at tp 2; --save-hf is refused in one line that says how to write the Hub folder instead."""
    from moezero.training.tensor_parallel_checks import tensor_parallel_refusals
    from tests.integration.pretrain_utils import configs

    cfg = configs(RUN + TP2["qwen3"] + ["--load-hf", str(tmp_path), "--save-hf", str(tmp_path / "out")])
    (line,) = tensor_parallel_refusals(cfg, world_size=2)
    assert line.startswith("--save-hf: not supported with --tensor-model-parallel-size > 1") and "\n" not in line
    assert "tools/hf_checkpoint.py export" in line
    # a MoE model at Megatron's default etp (= tp): the experts' etp slices are not read from Hub files yet
    moe = ["--num-experts", "4", "--moe-expert-capacity-factor", "-1"]
    cfg = configs(RUN + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--load-hf", str(tmp_path)] + moe)
    assert tensor_parallel_refusals(cfg, world_size=2) == [
        "--load-hf: not supported with --expert-tensor-parallel-size > 1 yet (--expert-tensor-parallel-size=2) "
        "(pass --expert-tensor-parallel-size 1)"
    ]
