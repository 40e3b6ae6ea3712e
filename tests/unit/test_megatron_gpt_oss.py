"""GPT-OSS's attention and MLP as Megatron's flags give them (examples/gptoss/02_train.sh: --quick-geglu
--glu-linear-offset 1 --activation-func-clamp-value --softmax-type learnable --window-size L,0
--window-attn-skip-freq 2), against megatron-core's own GPTModel holding moezero's weights (local spec, CPU,
float64): the same loss per token and the same gradient of every parameter, with biases, grouped-query
attention, a window shorter than the sequence on every other layer and a clamp that bites."""

import pytest
import torch

from moezero.models import GPTModel, language_model_loss
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import configs
from tests.megatron_oracle import CPU_BUILD, causal_mask, megatron_on_cpu, megatron_name, megatron_state, to_megatron

pytest.importorskip("megatron.core")

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, WINDOW, CLAMP = 3, 32, 4, 2, 48, 64, 16, 4, 0.05
FLAGS = [
    "--num-layers",
    str(LAYERS),
    "--hidden-size",
    str(HIDDEN),
    "--num-attention-heads",
    str(HEADS),
    "--group-query-attention",
    "--num-query-groups",
    str(GROUPS),
    "--seq-length",
    str(SEQ),
    "--ffn-hidden-size",
    str(FFN),
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--quick-geglu",
    "--glu-linear-offset",
    "1.0",
    "--activation-func-clamp-value",
    str(CLAMP),
    "--softmax-type",
    "learnable",
    "--window-size",
    f"{WINDOW},0",
    "--window-attn-skip-freq",
    "2",
]


def _megatron_model(softmax_type):
    from megatron.core.activations import quick_gelu
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=CLAMP,
        softmax_type=softmax_type,
        window_size=(WINDOW, 0),
        window_attn_skip_freq=2,
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **CPU_BUILD,
    )
    return MegatronGPT(
        config,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).double()


def _compare(softmax_type):
    cfg = configs([a if a != "learnable" else softmax_type for a in FLAGS])
    cfg.model.vocab_size = VOCAB
    torch.manual_seed(0)
    model = GPTModel(cfg.model, seed=3).double()
    with torch.no_grad():  # norms, biases and sinks away from their init, so a swapped one shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype))
    tokens, labels = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
    loss = language_model_loss(model(tokens)[0], labels, torch.ones(2, SEQ))
    loss.backward()
    with megatron_on_cpu():
        theirs = _megatron_model(softmax_type)
        params = dict(theirs.named_parameters())
        state = megatron_state(model, HEADS, GROUPS)
        assert sorted(params) == sorted(state), sorted(set(params) ^ set(state))
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
        positions = torch.arange(SEQ).expand(2, SEQ)
        # megatron-core's jit_fuser wraps quick_gelu in torch.compile: the oracle runs the same function eagerly,
        # without compiling it first
        with torch._dynamo.config.patch(disable=True):
            their_loss = theirs(tokens, positions, causal_mask(SEQ), labels=labels).mean()
            their_loss.backward()
    ours = {megatron_name(n): to_megatron(n, p.grad, HEADS, GROUPS) for n, p in model.named_parameters()}
    errors = {name: (ours[name] - params[name].grad).abs().max().item() for name in ours}
    windowed = [m.attention.window for m in model.layers]
    return loss.item() - their_loss.item(), errors, windowed


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_gpt_oss_flags_build_megatron_cores_model(softmax_type):
    loss_error, grad_errors, windowed = run_distributed(_compare, 1, softmax_type, timeout=300)[0]
    assert windowed == [WINDOW, None, WINDOW]  # Megatron counts layers from 1: every 2nd is full attention
    # megatron-core's cross-entropy runs in fp32 (logits.float()), so its loss holds 7 digits and the gradients
    # agree to 1e-7, not 1e-15; a wrong mask, sink, clamp or offset is off by 1e-4 or more
    assert abs(loss_error) < 1e-6
    assert max(grad_errors.values()) < 1e-7, sorted(grad_errors.items(), key=lambda kv: -kv[1])[:3]
    assert any(name.endswith("softmax_offset") for name in grad_errors) == (softmax_type == "learnable")
