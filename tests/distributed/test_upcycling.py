"""--moe-use-upcycling: an MoE model whose experts are copies of a dense model's MLPs gives the dense model's
logits (float64, 2 ranks, ep 2) for the routers whose top-k weights sum to 1, with and without biases, GELU or
SwiGLU, and dense layers left in place; the settings under which it would not are refused by name.

At tensor and expert-tensor parallelism each rank copies in its slices of the dense tensors: the script's upcycled
run at tp 2 with sequence parallelism (ep 2 folded at etp 1, and Megatron's default etp = tp) and at tp 1 etp 2,
from a tp 1 or a tp 2 dense checkpoint, follows one process's upcycled run (float64, 1e-10), whose first loss is
the dense model's; so does tp 2 x pp 2 on 4 ranks, each stage's ranks filling their slices of its layers."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.parallel import ParallelGroups
from moezero.models.upcycling import check_upcyclable, upcycle
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, assert_same_curve, run_in_process

DENSE = {
    "llama-like": dict(
        swiglu=True,
        disable_bias_linear=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
    ),
    "gpt-like": dict(),
}
ROUTERS = {
    "softmax top-2": dict(top_k=2),
    "sigmoid top-3": dict(top_k=3, score_function="sigmoid"),
    "softmax top-1": dict(top_k=1),
}


def _upcycled_logits_equal_dense(dense_kind, router, moe_layer_freq):
    groups = ParallelGroups.build(expert_parallel_size=2)
    gpt = GPTConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=12,
        vocab_size=61,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_layer_freq=moe_layer_freq,
        **DENSE[dense_kind],
    )
    dense = GPTModel(gpt, seed=1).double()
    with torch.no_grad():  # biases and norms away from their init, so copying them is seen
        for p in dense.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.05)
    moe = MoEConfig(num_experts=4, **ROUTERS[router])
    check_upcyclable(gpt, moe)
    model = GPTModel(gpt, moe, seed=2, moe_layer=expert_parallel(groups)).double()
    upcycle(model, dense.state_dict())
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[0], dense(tokens)[0], rtol=0, atol=1e-12)
    groups.destroy()
    return True


def _all_cases():
    for dense_kind in DENSE:
        for router in ROUTERS:
            _upcycled_logits_equal_dense(dense_kind, router, 1)
    _upcycled_logits_equal_dense("llama-like", "softmax top-2", [0, 1, 1])
    return True


# dropless (upcycling's condition), float64, a dense first layer; the padded vocabulary the same at tp 1 and 2
RUN = [flag for i, flag in enumerate(TINY) if "capacity" not in flag and "capacity" not in TINY[i - 1]]
RUN += ["--num-layers", "3", "--moe-layer-freq", "[0,1,1]", "--zero-stage", "1", "--fp64", "--log-interval", "1"]
RUN += ["--swiglu", "--make-vocab-size-divisible-by", "256", "--train-iters", "3"]
MOE_FLAGS = {"--num-experts", "--moe-router-topk"}


def _dense(run):
    return [a for i, a in enumerate(run) if a not in MOE_FLAGS and run[i - 1] not in MOE_FLAGS]


DENSE_RUN = _dense(RUN)
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # etp: tp's (Megatron's default)
LAYOUTS = {  # the layout and where its dense checkpoint was saved
    "tp 2, ep 2 folded, etp 1": (TP2 + ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], 1),
    "tp 2, etp 2": (TP2, 2),
    "tp 1, etp 2": (["--expert-tensor-parallel-size", "2"], 2),
}


def _model_cases_and_tp_runs(cache, dense_tp1, dense_tp2):
    """The model-level cases above, then in the same world a tp 2 dense checkpoint and each layout's upcycled run
    (from the tp 1 or the tp 2 checkpoint)."""
    _all_cases()
    run_in_process(DENSE_RUN + cache + TP2 + ["--train-iters", "2", "--save", dense_tp2])
    dense = {1: dense_tp1, 2: dense_tp2}
    return {
        (layout, saved_at): run_in_process(RUN + cache + flags + ["--load", dense[saved_at], "--moe-use-upcycling"])
        for layout, (flags, saved_at) in LAYOUTS.items()
    }


def test_upcycled_logits_are_the_dense_models_and_tp_runs_follow_one_process(tmp_path):
    """One process's upcycled run starts at the dense model's loss (the same first batch, its checkpoint's weights
    with --finetune); each rank's slices then make every layout's curve that run's."""
    cache, dense_tp1, dense_tp2 = ["--data-cache-path", str(tmp_path)], str(tmp_path / "tp1"), str(tmp_path / "tp2")
    run_in_process(DENSE_RUN + cache + ["--train-iters", "2", "--save", dense_tp1])
    dense, _ = run_in_process(DENSE_RUN + cache + ["--load", dense_tp1, "--finetune", "--train-iters", "1"])
    single, output = run_in_process(RUN + cache + ["--load", dense_tp1, "--moe-use-upcycling"])
    assert "--moe-use-upcycling: the experts start as the dense MLPs of" in output
    assert abs(single[0]["lm_loss"] - dense[0]["lm_loss"]) <= 1e-12, (single[0], dense[0])
    for rank, runs in enumerate(run_distributed(_model_cases_and_tp_runs, 2, cache, dense_tp1, dense_tp2, timeout=400)):
        for (layout, saved_at), (history, output) in runs.items():
            assert rank == 1 or "--moe-use-upcycling: the experts start as the dense MLPs of" in output
            assert_same_curve(f"{layout}, from a tp {saved_at} dense checkpoint", history, single)


@pytest.mark.parametrize(
    "moe, message",
    [
        (dict(top_k=1, pre_softmax=True), "not --moe-router-pre-softmax"),
        (dict(top_k=2, capacity_factor=1.0), "dropless routing"),
        (dict(top_k=2, shared_expert_intermediate_size=16), "no shared expert"),
        (dict(top_k=2, ffn_hidden_size=16), "--moe-ffn-hidden-size must be the dense width"),
        (dict(top_k=1, score_function="sigmoid"), "sigmoid needs top-k > 1"),
        (
            dict(top_k=2, load_balancing_type="sinkhorn", aux_loss_coeff=0.0),
            "not --moe-router-load-balancing-type sinkhorn",
        ),
    ],
)
def test_what_would_change_the_logits_is_refused(moe, message):
    gpt = GPTConfig(hidden_size=32, num_attention_heads=4, vocab_size=61)
    with pytest.raises(ConfigError, match=f"--moe-use-upcycling: .*{message}"):
        check_upcyclable(gpt, MoEConfig(num_experts=4, **moe))


def test_the_mtp_depths_mlps_are_upcycled_too():
    """An MTP depth's MoE layer takes the dense depth's MLP (Megatron matches experts by suffix): the main and
    the depth's logits are the dense model's (one process, float64)."""
    gpt = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=12,
        vocab_size=61,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding_type="rope",
        mtp_num_layers=1,
    )
    dense = GPTModel(gpt, seed=1).double()
    model = GPTModel(gpt, MoEConfig(num_experts=4, top_k=2), seed=2).double()
    upcycle(model, dense.state_dict())
    tokens = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (logits, _, depths), (dense_logits, _, dense_depths) = model(tokens, mtp=True), dense(tokens, mtp=True)
    torch.testing.assert_close(logits, dense_logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(depths[0], dense_depths[0], rtol=0, atol=1e-12)


# 4 layers over 2 stages, the first dense; tp 2 with SP, the experts at Megatron's default etp (tp)
PP_RUN = RUN + ["--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]"]
TP2_PP2 = TP2 + ["--pipeline-model-parallel-size", "2"]


def test_upcycling_at_tp2_x_pp2_follows_one_process(tmp_path):
    """With pipeline stages each stage's ranks copy in their tp and etp slices of its layers' dense tensors: the
    script's upcycled run at tp 2 (SP, etp 2) x pp 2 on 4 ranks follows one process's (float64, 1e-10)."""
    cache, dense = ["--data-cache-path", str(tmp_path)], str(tmp_path / "dense")
    run_in_process(_dense(PP_RUN) + cache + ["--train-iters", "2", "--save", dense])
    upcycled = PP_RUN + cache + ["--load", dense, "--moe-use-upcycling"]
    single, _ = run_in_process(upcycled)
    ranks = run_distributed(run_in_process, 4, upcycled + TP2_PP2, timeout=400)
    assert any("--moe-use-upcycling: the experts start as the dense MLPs of" in output for _, output in ranks)
    for history, _ in ranks:
        assert_same_curve("tp 2 x pp 2", history, single)


def test_tp_and_etp_upcycling_validate_with_and_without_pipeline_stages():
    """Upcycling runs at tp 2 and tp 1 etp 2 (above), with pipeline stages too."""
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import configs

    pp2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]"]
    for flags, _ in LAYOUTS.values():
        validate(configs(RUN + ["--moe-use-upcycling"] + flags), world_size=2)
        validate(configs(RUN + ["--moe-use-upcycling"] + flags + pp2), world_size=4)


def test_a_dense_tensor_of_another_shape_is_refused_by_name():
    gpt = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=12, vocab_size=61)
    dense = GPTModel(dataclasses.replace(gpt, ffn_hidden_size=64), seed=1).state_dict()  # narrower MLPs
    model = GPTModel(gpt, MoEConfig(num_experts=4, top_k=2), seed=2)
    with pytest.raises(
        ConfigError, match=r"--moe-use-upcycling: the dense checkpoint's tensor for .*experts.w1 is shaped"
    ):
        upcycle(model, dense)
