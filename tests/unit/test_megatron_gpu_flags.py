"""Megatron flags that blocked real launch lines: GPU execution and checkpointing choices (accepted, with Megatron's
rules), --deterministic-mode (torch's deterministic algorithms), --apply-query-key-layer-scaling (against
megatron-core's DotProductAttention, bit for bit in fp16 and bf16) and --apply-wd-to-qk-layernorm (against its
get_standard_config_overrides)."""

import pytest
import torch
from einops import rearrange

from moezero.config import ConfigError
from moezero.models.attention import causal_attention
from moezero.training.configs import validate
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs
from tests.megatron_oracle import CPU_BUILD, causal_mask, megatron_on_cpu

pytest.importorskip("megatron.core")

ACCEPTED = [
    "--use-persistent-ckpt-worker",
    "--ckpt-assume-constant-structure",
    "--dist-ckpt-optim-fully-reshardable",
    "--async-strategy",
    "mcore",
    "--async-ckpt-use-cpu-shm",
    "--use-transformer-engine-op-fuser",
    "--cuda-graph-impl",
    "transformer_engine",
    "--cuda-graph-modules",
    "attn",
    "moe_router",
]


def test_gpu_execution_and_checkpointing_flags_are_accepted_with_megatrons_rules():
    validate(configs(TINY + ACCEPTED), world_size=1)
    for argv, needle in (
        (["--tp-comm-overlap"], "--tp-comm-overlap: Transformer Engine's overlap of the tensor-parallel exchanges"),
        (["--tp-comm-overlap", "--sequence-parallel"], "--tp-comm-overlap: Transformer Engine's overlap"),
        (
            ["--cuda-graph-impl", "local", "--expert-model-parallel-size", "2"],
            "--cuda-graph-impl local: with --expert-model-parallel-size > 1 Megatron needs",
        ),
    ):
        with pytest.raises(ConfigError, match=needle):
            validate(configs(TINY + argv), world_size=2)


def _megatron_accepts(**fields) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            num_moe_experts=4,
            add_bias_linear=False,
            expert_model_parallel_size=2,
            overlap_moe_expert_parallel_comm=True,
            bf16=True,
            moe_token_dispatcher_type="alltoall",
            **fields,
            **CPU_BUILD,
        )
    except (ValueError, AssertionError):
        return False
    return True


def test_cuda_graphs_with_the_expert_parallel_overlap_follow_transformer_configs_rule():
    overlap = TINY + [
        "--overlap-moe-expert-parallel-comm",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--expert-model-parallel-size",
        "2",
    ]
    assert not _megatron_accepts(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe"])
    assert _megatron_accepts(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"])
    with pytest.raises(ConfigError, match="--cuda-graph-impl transformer_engine: with --overlap-moe-expert-"):
        validate(
            configs(overlap + ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "moe"]), world_size=2
        )
    validate(
        configs(overlap + ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn"]), world_size=2
    )


def test_deterministic_mode_refuses_what_megatron_refuses_and_trains_deterministically(tmp_path, monkeypatch):
    from moezero.recipe import pretraining

    for flag in ("--use-flash-attn", "--cross-entropy-loss-fusion"):
        with pytest.raises(ConfigError, match=f"--deterministic-mode: not with {flag}"):
            validate(configs(TINY + ["--deterministic-mode", flag]), world_size=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU run must have in its environment
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    with pytest.raises(ConfigError, match="--deterministic-mode: needs CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        validate(configs(TINY + ["--deterministic-mode"]), world_size=1)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.delenv("NCCL_ALGO")
    with pytest.raises(ConfigError, match="--deterministic-mode: needs NCCL_ALGO set to one of Tree, Ring"):
        validate(configs(TINY + ["--deterministic-mode"]), world_size=1)
    validate(configs(TINY + ["--deterministic-mode", "--distributed-backend", "gloo"]), world_size=1)
    monkeypatch.undo()
    assert not torch.are_deterministic_algorithms_enabled()
    try:  # a run in this process: the setting is process-wide, as Megatron's
        run = pretraining(
            configs(TINY + ["--deterministic-mode", "--train-iters", "2", "--data-cache-path", str(tmp_path)])
        )
        assert torch.are_deterministic_algorithms_enabled()
        run.train()  # every op of a step has a deterministic implementation (torch raises otherwise)
        assert [h["iteration"] for h in run.history] == [1, 2]
        run.groups.destroy()
    finally:
        torch.use_deterministic_algorithms(False)


S, B, H, h, LAYER = 16, 2, 2, 8, 12


def _megatron_core_attention(dtype, scaling: bool, q, k, v):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    with megatron_on_cpu():
        config = TransformerConfig(
            num_layers=LAYER,
            hidden_size=H * h,
            num_attention_heads=H,
            attention_dropout=0.0,
            apply_query_key_layer_scaling=scaling,
            fp16=dtype == torch.float16,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            **CPU_BUILD,
        )
        attention = DotProductAttention(
            config, layer_number=LAYER, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )
        return attention(q.to(dtype), k.to(dtype), v.to(dtype), causal_mask(S))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_query_key_layer_scaling_is_megatron_cores_bit_for_bit(dtype):
    """Layer L's scores are q k^T * scale / L in fp16 (one GEMM with that alpha) and multiplied back by L in fp32
    before its fp32 softmax: megatron-core's local DotProductAttention with apply_query_key_layer_scaling, equal
    bit for bit; without the flag moezero's rounds otherwise."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, H, h, generator=g) * scale for scale in (30, 30, 1))  # scores in the thousands
    theirs = run_distributed(_megatron_core_attention, 1, dtype, True, q, k, v, timeout=120)[0]

    def ours(layer_scale):
        y = causal_attention(
            *(t.to(dtype).permute(1, 2, 0, 3) for t in (q, k, v)), 0.0, False, None, "x", layer_scale=layer_scale
        )
        return rearrange(y, "B H S h -> S B (H h)")

    assert torch.equal(ours(LAYER), theirs)
    assert not torch.equal(ours(None), theirs)


def test_the_layer_scale_is_megatrons_layer_number_mtp_depths_included():
    from moezero.models import GPTModel

    cfg = configs(
        TINY + ["--apply-query-key-layer-scaling", "--mtp-num-layers", "1", "--position-embedding-type", "rope"]
    )
    model = GPTModel(cfg.model.__class__(**{**cfg.model.__dict__, "vocab_size": 64}), cfg.moe)
    assert [layer.attention.layer_scale for layer in model.layers] == [1, 2]
    assert model.mtp[0].layer.attention.layer_scale == 3  # megatron-core numbers the MTP layer after the decoder
    plain = configs(TINY)
    assert (
        GPTModel(plain.model.__class__(**{**plain.model.__dict__, "vocab_size": 64}), plain.moe)
        .layers[0]
        .attention.layer_scale
        is None
    )


@pytest.mark.parametrize(
    "attention",
    [
        ["--qk-layernorm"],
        [
            "--qk-layernorm",
            "--multi-latent-attention",
            "--q-lora-rank",
            "16",
            "--kv-lora-rank",
            "16",
            "--qk-head-dim",
            "8",
            "--qk-pos-emb-head-dim",
            "8",
            "--v-head-dim",
            "8",
        ],
    ],
)
def test_weight_decay_on_the_qk_norms_is_megatron_cores_rule(attention):
    """megatron-core's get_standard_config_overrides with apply_wd_to_qk_layernorm decays the params named
    q_layernorm. / k_layernorm. (moezero's q_norm / k_norm; MLA's kv_layernorm is not one of them)."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    from moezero.models import GPTModel
    from moezero.parallel import is_expert_parallel
    from moezero.training.builders import megatron_param_groups

    cfg = configs(
        TINY + attention + ["--apply-wd-to-qk-layernorm", "--weight-decay", "0.1", "--normalization", "LayerNorm"]
    )
    model = GPTModel(cfg.model.__class__(**{**cfg.model.__dict__, "vocab_size": 64}), cfg.moe)
    groups = megatron_param_groups(model, cfg.train)
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    overrides = get_standard_config_overrides(OptimizerConfig(lr=1e-3, apply_wd_to_qk_layernorm=True))
    qk_norms = 0
    for name, p in model.named_parameters():
        theirs_name = (
            name.replace(".kv_norm.", ".kv_layernorm.")
            .replace(".q_norm.", ".q_layernorm.")
            .replace(".k_norm.", ".k_layernorm.")
        )
        one = p[0] if is_expert_parallel(p) else p
        wd_mult = 1.0
        for key, override in overrides.items():
            if key.matches(one, theirs_name):
                wd_mult = override.get("wd_mult", wd_mult)
        assert decay_of[id(p)] == 0.1 * wd_mult, name
        qk_norms += ".q_norm." in name or ".k_norm." in name
    assert qk_norms >= 4 and any(".kv_norm." in n or ".mlp_norm." in n for n, _ in model.named_parameters())
    without = megatron_param_groups(model, configs(TINY + attention).train)
    assert all(g["weight_decay"] == 0 for g in without for p in g["params"] if p.ndim == 1)
