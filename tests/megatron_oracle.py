"""megatron-core's own GPTModel as an oracle on the CPU: built from a TransformerConfig with its local spec in a
one-rank gloo world (run it inside `run_distributed(fn, 1, ...)`), holding a moezero model's weights.

`megatron_state(model)` gives moezero's parameters under megatron-core's names and layouts; `megatron_on_cpu()`
points what its local spec reaches for on a GPU (the RNG tracker's fork around attention dropout, its loss
tracker's device, the sliding-window mask's device, the router's TransformerEngine GEMM) at the CPU.
"""

from __future__ import annotations

import contextlib
import types

import torch

# moezero's module name in a layer -> megatron-core's (the local spec's)
_LAYER_NAMES = {
    "input_norm": "input_layernorm",
    "mlp_norm": "pre_mlp_layernorm",
    "attention.proj": "self_attention.linear_proj",
    "attention.qkv": "self_attention.linear_qkv",
    "attention": "self_attention.core_attention",
    "mlp.fc1": "mlp.linear_fc1",
    "mlp.fc2": "mlp.linear_fc2",
}


def megatron_name(ours: str) -> str:
    fixed = {
        "embedding.weight": "embedding.word_embeddings.weight",
        "output.weight": "output_layer.weight",
        "final_norm.weight": "decoder.final_layernorm.weight",
    }
    if ours in fixed:
        return fixed[ours]
    parts = ours.split(".")
    if parts[0] == "layers":
        prefix, rest = f"decoder.layers.{parts[1]}.", ".".join(parts[2:])
    elif parts[2] == "layer":  # mtp.{k}.layer.*
        prefix, rest = f"mtp.layers.{parts[1]}.transformer_layer.", ".".join(parts[3:])
    else:  # mtp.{k}.enorm / hnorm / eh_proj / final_norm
        return f"mtp.layers.{parts[1]}." + ".".join(parts[2:]).replace("final_norm", "final_layernorm")
    module, param = rest.rsplit(".", 1)
    return prefix + _LAYER_NAMES[module] + "." + param


def to_megatron(name: str, tensor: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """Megatron's fused q/k/v holds each key/value group's queries, key and value together; moezero's all
    queries, then keys, then values (weight and bias alike)."""
    if ".attention.qkv." not in name:
        return tensor
    head_dim = tensor.shape[0] // (heads + 2 * groups)
    rest = tensor.shape[1:]
    q, k, v = tensor.split([heads * head_dim, groups * head_dim, groups * head_dim])
    per_group = [
        q.reshape(groups, heads // groups * head_dim, *rest),
        k.reshape(groups, head_dim, *rest),
        v.reshape(groups, head_dim, *rest),
    ]
    return torch.cat(per_group, dim=1).reshape(tensor.shape)


def megatron_state(model, heads: int, groups: int):
    return {megatron_name(n): to_megatron(n, p.detach(), heads, groups) for n, p in model.named_parameters()}


def _sliding_window_mask_on_cpu(sq, skv, window_size):
    keep = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq - window_size[0]).tril(skv - sq + window_size[1])
    return ~keep


@contextlib.contextmanager
def megatron_on_cpu():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.moe import moe_utils

    saved = (
        torch.cuda.current_device,
        tensor_parallel.get_cuda_rng_tracker,
        fused_softmax.get_sliding_window_causal_mask,
    )
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: types.SimpleNamespace(
        fork=lambda *a, **k: contextlib.nullcontext()
    )
    fused_softmax.get_sliding_window_causal_mask = _sliding_window_mask_on_cpu
    if not hasattr(moe_utils, "te_general_gemm"):  # its router's gate reads it, unset without TransformerEngine
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        (
            torch.cuda.current_device,
            tensor_parallel.get_cuda_rng_tracker,
            fused_softmax.get_sliding_window_causal_mask,
        ) = saved


CPU_BUILD = dict(
    use_cpu_initialization=True,
    perform_initialization=False,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    bias_dropout_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
)


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()
