"""An absolute oracle for the GPT: the default dense configuration (learned positions, LayerNorm, GELU,
tied head, biases) is GPT-2's architecture, so with the same weights transformers' GPT2LMHeadModel must
give the same logits (float64). Its GELU is GPT-2's own tanh approximation ("gelu_new"), as Megatron's default
--bias-gelu-fusion gives; with --no-bias-gelu-fusion it is the exact one ("gelu"). The golden loss file checks numbers
across commits; this checks them
against an implementation that is not ours.
"""

import pytest
import torch

from moezero.config import GPTConfig
from moezero.models import GPTModel

transformers = pytest.importorskip("transformers")  # a test extra: `pip install -e .[dev]`

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 3, 48, 4, 24, 101


def _gpt2_with_moezero_weights(model: GPTModel, activation: str):
    """GPT2LMHeadModel holding `model`'s weights (GPT-2's Conv1D stores weights transposed)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        activation_function=activation,
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    gpt2 = transformers.GPT2LMHeadModel(config).double().eval()
    ours = {name: p.detach() for name, p in model.named_parameters()}
    theirs = {
        "transformer.wte.weight": ours["embedding.weight"],
        "transformer.wpe.weight": ours["position_embedding.weight"],
        "transformer.ln_f.weight": ours["final_norm.weight"],
        "transformer.ln_f.bias": ours["final_norm.bias"],
    }
    for i in range(LAYERS):
        mine, hf = f"layers.{i}.", f"transformer.h.{i}."
        for our_part, their_part, transpose in (
            ("input_norm", "ln_1", False),
            ("mlp_norm", "ln_2", False),
            ("attention.qkv", "attn.c_attn", True),
            ("attention.proj", "attn.c_proj", True),
            ("mlp.fc1", "mlp.c_fc", True),
            ("mlp.fc2", "mlp.c_proj", True),
        ):
            weight = ours[f"{mine}{our_part}.weight"]
            theirs[f"{hf}{their_part}.weight"] = weight.t() if transpose else weight
            theirs[f"{hf}{their_part}.bias"] = ours[f"{mine}{our_part}.bias"]
    state = gpt2.state_dict()
    with torch.no_grad():
        for name, tensor in theirs.items():
            state[name].copy_(tensor)
    assert torch.equal(gpt2.lm_head.weight, gpt2.transformer.wte.weight), "the head is tied"
    return gpt2


@pytest.mark.parametrize("exact_gelu, activation", [(False, "gelu_new"), (True, "gelu")])
def test_the_default_dense_gpt_is_gpt2(exact_gelu, activation):
    config = GPTConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        seq_length=SEQ,
        vocab_size=VOCAB,
        no_bias_gelu_fusion=exact_gelu,
    )
    assert (
        config.position_embedding_type,
        config.normalization,
        config.swiglu,
        config.untie_embeddings_and_output_weights,
    ) == ("learned_absolute", "LayerNorm", False, False)
    model = GPTModel(config, seed=11).double().eval()
    with torch.no_grad():  # non-trivial norms and biases: the default init has ones and zeros there
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(
                    torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype) * 0.1
                    + (1.0 if "norm" in name else 0.0)
                )
    gpt2 = _gpt2_with_moezero_weights(model, activation)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model(tokens)
        theirs = gpt2(tokens).logits
    assert ours.std() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
