"""transformers as the oracle of moezero's Hugging Face families: tiny random models built from configs (no
download), and a float64 that stays float64.

transformers' float64 models are not float64 throughout: RMSNorm, the attention softmax and the routers cast
to float32 by hand. `Float64Throughout` is a torch function mode under which such a cast of a float64
tensor keeps float64 (nothing else changes), so the oracle's numbers are its own formulas at float64 and
parity can be asked to 1e-8.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

transformers = __import__("pytest").importorskip("transformers")


def _is_f64(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


class Float64Throughout(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        source = args[0] if args else None
        if func is torch.Tensor.float and _is_f64(source):
            return source
        if _is_f64(source) or any(_is_f64(a) for a in args[1:2]):
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


COMMON = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    num_experts_per_tok=2,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _deepseek(**routing):
    return dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        intermediate_size=40,
        moe_intermediate_size=12,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        first_k_dense_replace=1,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **routing,
    )


def _yarn(**more):
    """YaRN from 16 to the 64 positions of the tiny models (factor 4)."""
    return dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, **more)


CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON,
        intermediate_size=40,
        num_local_experts=4,
        rope_theta=1e6,
        tie_word_embeddings=True,
        sliding_window=None,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=4,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        tie_word_embeddings=False,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        head_dim=12,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_experts=4,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        tie_word_embeddings=False,
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, intermediate_size=24, num_experts=4, norm_topk_prob=False, tie_word_embeddings=False
    ),
    # the dense sources of upcycling
    "llama": lambda: transformers.LlamaConfig(**COMMON, intermediate_size=40, tie_word_embeddings=True, rope_theta=5e5),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=12, intermediate_size=40, tie_word_embeddings=False),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **_deepseek(
            q_lora_rank=None,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            rope_parameters=_yarn(mscale=0.707, mscale_all_dim=0.707),
        )
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **_deepseek(
            q_lora_rank=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters=_yarn(mscale=1.0, mscale_all_dim=1.0),
        )
    ),
    # GLM-4.5: RoPE on half of each head, q/k/v biases, per-head q/k norms, DeepSeek-V3's router
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **COMMON,
        head_dim=12,
        intermediate_size=40,
        moe_intermediate_size=12,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        rope_theta=1e6,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    ),
    # GPT-OSS: biases, sinks, a 5-key window on layers 1 and 3, YaRN without rounding, a clamp that bites
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON,
        head_dim=12,
        intermediate_size=24,
        num_local_experts=4,
        sliding_window=5,
        swiglu_limit=0.5,
        rope_parameters=_yarn(truncate=False, beta_fast=8.0, beta_slow=1.0),
        tie_word_embeddings=False,
    ),
    # Kimi-K2: DeepSeek-V3's architecture, one expert group, YaRN with beta 1/1 (its config.json says kimi_k2)
    "kimi_k2": lambda: transformers.DeepseekV3Config(
        **_deepseek(
            q_lora_rank=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            norm_topk_prob=True,
            rope_parameters=_yarn(mscale=1.0, mscale_all_dim=1.0, beta_fast=1.0, beta_slow=1.0),
        )
    ),
}


def tiny_model(family: str, seed: int = 0, **config_fields):
    """A float64 transformers model of `family` with random weights everywhere (norms around 1); its config
    with `config_fields` changed."""
    config = CONFIGS[family]()
    for name, value in config_fields.items():
        setattr(config, name, value)
    model = (
        transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", experts_implementation="eager"
        )
        .double()
        .eval()
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection-only bias: not zero
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator, dtype=buffer.dtype))
    return model


def save_tiny_model(family: str, path: str, seed: int = 0):
    """tiny_model's weights as transformers saves them; Kimi-K2's config says kimi_k2 as its Hub files do."""
    model = tiny_model(family, seed)
    model.save_pretrained(path)
    if family == "kimi_k2":
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["model_type"] = "kimi_k2"
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return model


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), Float64Throughout():
        return model(tokens).logits


def hub_tensors(path: str):
    """Every tensor of a Hub directory's safetensors files, by key."""
    out = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def load_with_transformers(path: str):
    """transformers' model of a Hub directory, float64 as tiny_model's: from_pretrained keeps RoPE's inverse
    frequencies in float32 (.double() makes them what a float64 model built from its config has) and loads
    some tensors rounded to float32 (DeepSeek-V3's router weight and bias), which are copied again from the
    files at their float64."""
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
        )
        .double()
        .eval()
    )
    state = model.state_dict()
    with torch.no_grad():
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), "pt") as f:
                    for key in f.keys():
                        if key in state and f.get_slice(key).get_dtype() == "F64":
                            state[key].copy_(f.get_tensor(key))
    return model


def mtp_layer(tensors, last: int, seed: int = 5):
    """A multi-token-prediction layer after decoder layer `last`, as DeepSeek's and GLM's own files hold one (Hub
    layer last + 1): a layer like the last (random weights of its shapes, in its dtype), enorm, hnorm, eh_proj,
    shared_head.norm, and copies of the embedding and head."""
    generator = torch.Generator().manual_seed(seed)
    first, mine = f"model.layers.{last}.", f"model.layers.{last + 1}."
    dtype = tensors["model.embed_tokens.weight"].dtype

    def rand(*shape, around=0.0):
        return (around + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)

    out = {mine + k[len(first) :]: rand(*v.shape).to(v.dtype) for k, v in tensors.items() if k.startswith(first)}
    hidden = tensors["model.norm.weight"].shape[0]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{mine}{name}.weight"] = rand(hidden, around=1.0)
    out[mine + "eh_proj.weight"] = rand(hidden, 2 * hidden)
    out[mine + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[mine + "shared_head.head.weight"] = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]).clone()
    return out


def add_mtp_layer(path: str) -> None:
    """A Hub directory with one file (transformers' save of a tiny model) given an MTP layer after its last, and
    num_nextn_predict_layers 1 in its config."""
    from safetensors.torch import save_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tensors = hub_tensors(path)
    tensors.update(mtp_layer(tensors, config["num_hidden_layers"] - 1))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
