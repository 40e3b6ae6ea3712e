"""The attention variants of the open MoE families beyond what the transformers parity covers: partial RoPE
(--rotary-percent) against megatron-core's own RoPE, and the explicit path keyed dropout takes against SDPA's
for grouped-query and multi-latent attention."""

import math

import pytest
import torch

from moezero.config import GPTConfig
from moezero.models import attention as attention_module
from moezero.models.attention import CausalSelfAttention, _explicit_attention
from moezero.models.mla import MultiLatentAttention
from moezero.models.rope import Rotary


def test_partial_rope_is_megatrons(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # its table moves to the GPU once
    embeddings = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    head_dim, percent, base, S = 24, 0.5, 5000.0, 10
    theirs_rope = embeddings.RotaryEmbedding(
        kv_channels=head_dim, rotary_percent=percent, rotary_base=base, use_cpu_initialization=True
    )
    x_SBHh = torch.randn(S, 2, 3, head_dim, generator=torch.Generator().manual_seed(0))
    theirs = rope_utils._apply_rotary_pos_emb_bshd(x_SBHh, theirs_rope.get_emb(S))
    config = GPTConfig(
        hidden_size=48,
        num_attention_heads=2,
        position_embedding_type="rope",
        rotary_percent=percent,
        rotary_base=base,
        seq_length=S,
        vocab_size=11,
    )
    ours = Rotary(config.rotary_dim, base)(x_SBHh.permute(1, 2, 0, 3)).permute(2, 0, 1, 3)
    # the same fp32 formulas; cos/sin of tables laid out differently may round apart by an ulp on other SIMD
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert torch.equal(ours[..., 12:], x_SBHh[..., 12:]), "the last half of each head is not rotated"


def test_grouped_query_attention_explicit_path_is_sdpas(monkeypatch):
    config = GPTConfig(
        hidden_size=48,
        num_attention_heads=6,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=10,
        attention_dropout=0.1,
        position_embedding_type="rope",
        seq_length=12,
        vocab_size=11,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    attention = CausalSelfAttention(config, site="a").double()
    assert attention.qkv.weight.shape == ((6 + 2 * 2) * 10, 48)
    x = torch.randn(2, 12, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, k, v = attention._heads(attention.qkv(x))
    assert (q.shape[1], k.shape[1], v.shape[1]) == (6, 2, 2)
    monkeypatch.setattr(attention_module, "keyed_dropout", lambda probs, *args: probs)  # the dropout itself aside
    explicit = _explicit_attention(q, k, v, 0.1, None, "a", None)
    attention.eval()
    torch.testing.assert_close(explicit, attention._core(q, k, v, keys=None), rtol=0, atol=1e-13)
    # query heads 0-2 share key/value group 0, heads 3-5 group 1 (transformers' and Megatron's order)
    alone = torch.nn.functional.scaled_dot_product_attention(q[:, 3:4], k[:, 1:2], v[:, 1:2], is_causal=True)
    torch.testing.assert_close(explicit[:, 3:4], alone, rtol=0, atol=1e-13)


def test_multi_latent_attention_explicit_path_is_sdpas(monkeypatch):
    """MLA's softmax scale (1/sqrt(qk + pos) times YaRN's mscale^2) reaches both paths; values are narrower."""
    config = GPTConfig(
        hidden_size=32,
        num_attention_heads=4,
        multi_latent_attention=True,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        qk_layernorm=True,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        mscale_all_dim=1.0,
        seq_length=12,
        vocab_size=11,
        position_embedding_type="rope",
        normalization="RMSNorm",
    )
    attention = MultiLatentAttention(config, site="a").double()
    assert attention.scale == pytest.approx(12**-0.5 * (0.1 * math.log(4.0) + 1) ** 2)
    x = torch.randn(2, 12, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    q, k_nope, k_pos, v = attention._heads(x)
    k = attention._keys(k_nope, k_pos)
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (12, 12, 6)
    monkeypatch.setattr(attention_module, "keyed_dropout", lambda probs, *args: probs)
    explicit = _explicit_attention(q, k, v, 0.1, None, "a", attention.scale)
    torch.testing.assert_close(explicit, attention.eval()._core(q, k, v, None), rtol=0, atol=1e-13)


@pytest.mark.parametrize("seq", [16, 128, 200])
@pytest.mark.parametrize("groups", [4, 2])
def test_the_cpu_attention_paths_give_sdpas_values(seq, groups):
    """Short bf16 sequences run two GEMMs and a softmax instead of SDPA's flash kernel (faster on the CPU): values
    and gradients within bf16's rounding of the float64 SDPA, GQA included; longer ones run SDPA itself."""
    from moezero.models.attention import EXPLICIT_CPU_MAX_SEQ, causal_attention

    torch.manual_seed(seq + groups)
    q64 = torch.randn(2, 4, seq, 32, dtype=torch.float64, requires_grad=True)
    k64, v64 = (torch.randn(2, groups, seq, 32, dtype=torch.float64, requires_grad=True) for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=groups != 4)
    want.sum().backward()
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q64, k64, v64))
    got = causal_attention(q, k, v, 0.0, True, None, "attn")
    got.float().sum().backward()
    assert (seq <= EXPLICIT_CPU_MAX_SEQ) == (seq != 200)
    for mine, ref in ((got, want), (q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(mine.double(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_short_cpu_sequences_run_sdpa_outside_bf16(dtype, monkeypatch):
    """Only bf16 takes the explicit path for short sequences on the CPU (fp16 is faster in SDPA there); keyed
    dropout takes it in every dtype."""
    from moezero.keyed_random import SampleKeys
    from moezero.models.attention import causal_attention

    calls = []
    explicit = attention_module._explicit_attention
    monkeypatch.setattr(attention_module, "_explicit_attention", lambda *a: calls.append(a[0].dtype) or explicit(*a))
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=dtype) for _ in range(3))
    causal_attention(q, k, v, 0.0, True, None, "attn")
    assert calls == []
    causal_attention(q, k, v, 0.1, True, SampleKeys(7, 0, (0, 1)), "attn")
    causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.0, True, None, "attn")
    assert calls == [dtype, torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float16])
def test_the_causal_mask_gives_masked_fills_bits(dtype):
    """mask_future_ (a 0 / -inf bias added in place) gives masked_fill_'s probabilities and gradients bit for bit;
    in fp16 (masked_fill_ itself) a score that overflowed to +inf where it is masked stays out of the softmax."""
    from moezero.models.attention import mask_future_

    torch.manual_seed(3)
    for seq in (16, 128):
        scores = torch.randn(2, 3, seq, seq, dtype=dtype, requires_grad=True)
        grad = torch.randn(2, 3, seq, seq, dtype=dtype)
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        want = torch.softmax(scores.clone().masked_fill_(~causal, float("-inf")), -1)
        (want_grad,) = torch.autograd.grad(want, scores, grad)
        got = torch.softmax(mask_future_(scores.clone()), -1)
        (got_grad,) = torch.autograd.grad(got, scores, grad)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
        assert torch.equal(got[..., 0, 1:], torch.zeros_like(got[..., 0, 1:]))
    if dtype == torch.float16:
        overflowed = torch.zeros(1, 1, 4, 4, dtype=dtype)
        overflowed[..., 0, 3] = float("inf")
        assert torch.isfinite(torch.softmax(mask_future_(overflowed), -1)).all()
