"""--moe-use-upcycling: an MoE model whose experts are copies of a dense model's MLPs gives the dense model's
logits (float64, 2 ranks, ep 2) for the routers whose top-k weights sum to 1, with and without biases, GELU or
SwiGLU, and dense layers left in place; the settings under which it would not are refused by name."""

import pytest
import torch
import torch.distributed as dist

from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.models import GPTModel
from moezero.moe import expert_parallel
from moezero.parallel import ParallelGroups
from moezero.models.upcycling import check_upcyclable, upcycle
from tests.dist_utils import run_distributed

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


def test_upcycled_logits_are_the_dense_models():
    assert all(run_distributed(_all_cases, 2))


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
