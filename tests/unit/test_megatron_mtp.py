"""Multi-token prediction against megatron-core's own: its GPTModel with a MultiTokenPredictionBlock (the local
spec), built on the CPU in a one-rank gloo world, holding moezero's weights, gives the same lm loss per token,
the same MTP losses (what it logs as 'mtp_k loss') and, through its MTPLossAutoScaler, the same gradient of
every parameter as moezero's training loss (float64 but for its fp32 cross-entropy; masked positions; Megatron's
per-micro-batch mean and its
--calculate-per-token-loss)."""

import pytest
import torch

from moezero.config import GPTConfig
from moezero.models import GPTModel
from moezero.training.loop import _micro_batch_losses, _mtp_term
from tests.dist_utils import run_distributed
from tests.megatron_oracle import CPU_BUILD, causal_mask, megatron_on_cpu, megatron_state, megatron_name, to_megatron

pytest.importorskip("megatron.core")

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, DEPTHS, FACTOR = 2, 32, 4, 48, 64, 16, 2, 0.3


def _megatron_model(per_token: bool):
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=FACTOR,
        calculate_per_token_loss=per_token,
        **CPU_BUILD,
    )
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return MegatronGPT(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    ).double()


def _megatron_losses_and_grads(state, batch, per_token: bool):
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    with megatron_on_cpu():
        model = _megatron_model(per_token)
        params = dict(model.named_parameters())
        assert len(params) == len(state), sorted(set(params) ^ set(state))
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
        mask = batch["loss_mask"].double()
        positions = torch.arange(SEQ).expand_as(batch["tokens"])
        per_token_lm = model(batch["tokens"], positions, causal_mask(SEQ), labels=batch["labels"], loss_mask=mask)
        lm_sum = (per_token_lm * mask).sum()
        (lm_sum if per_token else lm_sum / mask.sum()).backward()
        logged = MTPLossLoggingHelper.tracker["values"].clone()
        MTPLossLoggingHelper.clean_loss_in_tracker()
        scale = mask.sum() if per_token else 1.0  # per-token: Megatron divides every grad by the lm tokens last
        return (lm_sum / mask.sum()).item(), logged, {name: p.grad / scale for name, p in params.items()}


def _ours(per_token: bool):
    torch.manual_seed(0)
    config = GPTConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        seq_length=SEQ,
        vocab_size=VOCAB,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        disable_bias_linear=True,
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=DEPTHS,
        mtp_loss_scaling_factor=FACTOR,
    )
    model = GPTModel(config, seed=3).double()
    with torch.no_grad():  # norms away from one, so a swapped norm shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, dtype=p.dtype))
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1))
    mask = torch.ones(3, SEQ)
    mask[0, 5:9] = 0
    mask[2, -4:] = 0
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}
    lm, _, _, depths = _micro_batch_losses(model, batch, None, mtp=True)
    (lm + _mtp_term(model, depths, batch, 1.0 if per_token else None)).backward()
    return model, batch, lm.item(), depths


def _compare(per_token: bool):
    model, batch, lm, depths = _ours(per_token)
    their_lm, logged, their_grads = _megatron_losses_and_grads(megatron_state(model, HEADS, HEADS), batch, per_token)
    ours = {megatron_name(n): to_megatron(n, p.grad, HEADS, HEADS) for n, p in model.named_parameters()}
    errors = {name: (ours[name] - their_grads[name]).abs().max().item() for name in ours}
    return lm - their_lm, [d.item() for d in depths], logged.tolist(), errors


@pytest.mark.parametrize("per_token", [False, True])
def test_mtp_losses_and_gradients_are_megatron_cores(per_token):
    lm_error, ours, logged, grad_errors = run_distributed(_compare, 1, per_token, timeout=300)[0]
    # megatron-core's cross-entropy casts the logits to fp32 (and its loss tracker is fp32): hence 1e-8, not 1e-15;
    # a wrong shift, norm or scale is off by 1e-3 or more
    assert abs(lm_error) < 1e-6
    assert len(ours) == DEPTHS and abs(ours[0] - ours[1]) > 1e-4
    torch.testing.assert_close(
        torch.tensor(ours, dtype=torch.float64), torch.tensor(logged, dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert max(grad_errors.values()) < 1e-7, sorted(grad_errors.items(), key=lambda kv: -kv[1])[:3]
    assert any(name.startswith("mtp.layers.1.") for name in grad_errors)
