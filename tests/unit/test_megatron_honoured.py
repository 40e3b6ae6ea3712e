"""Megatron flags moezero honours beyond the model sizes: recompute granularity and method, the MoE layer
recompute, the router dtype, the vocabulary padding, NullTokenizer, Llama2Tokenizer (SentencePiece),
--mock-data, Megatron-FSDP's sharding strategies (ZeRO stages) and --lr-warmup-init. Each is checked by its
effect."""

import pytest
import torch

from moezero.config import ConfigError, GPTConfig, MoEConfig
from moezero.models import GPTModel
from moezero.models.attention import CausalSelfAttention
from moezero.models.gpt import recompute_chunks
from moezero.moe import MoELayer
from moezero.parallel import ParallelGroups
from moezero.training.builders import build_model
from moezero.training.configs import TrainConfig
from moezero.training.lr_schedule import LearningRateSchedule
from tests.integration.pretrain_utils import configs

SMALL = dict(
    num_layers=4,
    hidden_size=16,
    num_attention_heads=2,
    seq_length=8,
    vocab_size=40,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def test_full_recompute_chunks_are_megatrons():
    def chunks(method, k):
        return recompute_chunks(
            GPTConfig(**SMALL, recompute_granularity="full", recompute_method=method, recompute_num_layers=k)
        )

    assert chunks("uniform", 2) == [(0, 2, True), (2, 4, True)]
    assert chunks("uniform", 3) == [(0, 3, True), (3, 4, True)]
    assert chunks("block", 1) == [(0, 1, True), (1, 4, False)]
    assert recompute_chunks(GPTConfig(**SMALL, recompute_activations=True)) == [(0, 4, False)]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(recompute_granularity="full"), "full needs --recompute-method"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers=None: full needs"),
        (dict(recompute_method="block"), "--recompute-method='block': needs --recompute-granularity full"),
        (
            dict(
                recompute_activations=True,
                recompute_granularity="full",
                recompute_method="block",
                recompute_num_layers=1,
            ),
            "--recompute-activations is --recompute-granularity selective",
        ),
    ],
)
def test_recompute_flags_follow_megatrons_rules(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        GPTConfig(**SMALL, **kwargs)


def _calls_in_backward(**gpt):
    """How often the core attention and the MoE layers run in one training step (forward and backward)."""
    model = GPTModel(GPTConfig(**SMALL, **gpt), MoEConfig(num_experts=4, top_k=2), seed=1).double()
    calls = {"attention": 0, "moe": 0}
    core = CausalSelfAttention._core

    def counted_core(self, *args):
        calls["attention"] += 1
        return core(self, *args)

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.register_forward_pre_hook(lambda *a: calls.__setitem__("moe", calls["moe"] + 1))  # entered
    CausalSelfAttention._core = counted_core
    try:
        logits, _ = model(torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0)))
        logits.square().mean().backward()
    finally:
        CausalSelfAttention._core = core
    return calls


def test_recompute_reruns_what_it_says_in_backward():
    assert _calls_in_backward() == {"attention": 4, "moe": 4}
    assert _calls_in_backward(recompute_activations=True) == {"attention": 8, "moe": 4}  # selective
    assert _calls_in_backward(moe_layer_recompute=True) == {"attention": 4, "moe": 8}
    assert _calls_in_backward(recompute_granularity="full", recompute_method="block", recompute_num_layers=1) == {
        "attention": 5,
        "moe": 5,
    }  # layer 0 only
    assert _calls_in_backward(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2) == {
        "attention": 8,
        "moe": 8,
    }


def _parts_in_backward(**gpt):
    """How often each --recompute-modules part runs in one training step (forward and backward) of a model with
    dense layers (odd) and MoE layers (even), and the step's gradients."""
    model = GPTModel(
        GPTConfig(**dict(SMALL, moe_layer_freq=2), **gpt), MoEConfig(num_experts=4, top_k=2), seed=1
    ).double()
    calls = {"norm": 0, "mlp": 0, "moe": 0}
    for layer in model.layers:
        for norm in (layer.input_norm, layer.mlp_norm):
            norm.register_forward_pre_hook(lambda *a: calls.__setitem__("norm", calls["norm"] + 1))
        kind = "moe" if isinstance(layer.mlp, MoELayer) else "mlp"
        layer.mlp.register_forward_pre_hook(lambda *a, kind=kind: calls.__setitem__(kind, calls[kind] + 1))
    logits, _ = model(torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0)))
    logits.square().mean().backward()
    return calls, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_recompute_modules_rerun_their_parts_and_change_no_number():
    """Megatron's --recompute-modules under selective recompute: mlp reruns the dense MLPs, moe the MoE layers,
    layernorm the layers' norms in backward; the gradients are the same bits."""
    plain, grads = _parts_in_backward()
    assert plain == {"norm": 8, "mlp": 2, "moe": 2}
    for modules, expected in (
        (["mlp"], {"norm": 8, "mlp": 4, "moe": 2}),
        (["moe"], {"norm": 8, "mlp": 2, "moe": 4}),
        (["layernorm", "core_attn"], {"norm": 16, "mlp": 2, "moe": 2}),
    ):
        calls, recomputed = _parts_in_backward(recompute_granularity="selective", recompute_modules=modules)
        assert calls == expected, modules
        assert all(torch.equal(recomputed[n], g) for n, g in grads.items()), modules
    assert _calls_in_backward(recompute_granularity="selective", recompute_modules=["moe"]) == {
        "attention": 4,
        "moe": 8,
    }  # without core_attn the attention is not recomputed
    with pytest.raises(ConfigError, match="mla_up_proj is only supported with --multi-latent-attention"):
        GPTConfig(**SMALL, recompute_granularity="selective", recompute_modules=["mla_up_proj"])


def test_router_dtype():
    x = torch.randn(6, 16, dtype=torch.float32)
    for dtype, expected in ((None, torch.float32), ("fp64", torch.float64)):
        layer = MoELayer(MoEConfig(hidden_size=16, num_experts=4, top_k=2, router_dtype=dtype, aux_loss_coeff=0.1))
        _, stats = layer(x)
        assert stats.aux_loss.dtype == expected, dtype


def _vocab(argv):
    cfg = configs(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"] + argv)
    return build_model(cfg, ParallelGroups.single(), 257).embedding.weight.shape[0]


def test_vocabulary_padding_is_megatrons():
    assert _vocab([]) == 384  # 257 up to a multiple of 128
    assert _vocab(["--make-vocab-size-divisible-by", "1"]) == 257
    assert _vocab(["--make-vocab-size-divisible-by", "64"]) == 320
    assert _vocab(["--vocab-size", "1000"]) == 1024  # --vocab-size is before the padding


def test_null_tokenizer_and_mock_data(tmp_path):
    from moezero.config import DataConfig
    from moezero.data import build_datasets

    data = build_datasets(
        DataConfig(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=100, data_cache_path=str(tmp_path)),
        16,
        1,
        num_samples=(50, 8, 0),
    )
    tok = data.tokenizer
    assert (tok.vocab_size, tok.eod, tok.tokenize("3 1 4"), tok.detokenize([3, 1, 4])) == (101, 100, [3, 1, 4], "3 1 4")
    sample = data.train[0]
    assert sample["tokens"].shape == (16,) and torch.equal(sample["labels"][:-1], sample["tokens"][1:])
    assert data.valid is not None and data.test is None
    with pytest.raises(ConfigError, match="NullTokenizer needs --vocab-size"):
        DataConfig(tokenizer_type="NullTokenizer")
    with pytest.raises(ConfigError, match="--mock-data=True: replaces --data-path"):
        DataConfig(mock_data=True, data_path="x")


def test_llama2_tokenizer_reads_a_sentencepiece_model(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")  # an optional extra, in the dev extra
    from moezero.data.tokenizer import Llama2Tokenizer

    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"the expert {i} routes token {i * 7} to layer {i % 5}" for i in range(300)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=60,
        model_type="bpe",
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    tok = Llama2Tokenizer(str(tmp_path / "sp.model"))
    ids = tok.tokenize("the expert routes a token")
    assert ids[0] == tok.bos == 1 and tok.eod == 2 and tok.vocab_size == 60
    assert tok.detokenize(ids[1:]) == "the expert routes a token"


@pytest.mark.parametrize(
    "flags,stage",
    [
        (["--use-megatron-fsdp"], 3),  # Megatron's default strategy shards optimizer, grads and params
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"], 2),
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--use-distributed-optimizer"], 1),
        (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard"], 0),
        (["--data-parallel-sharding-strategy", "no_shard"], 2),  # without --use-megatron-fsdp it says nothing
    ],
)
def test_megatron_fsdp_is_a_zero_stage(flags, stage):
    assert configs(flags).zero.stage == stage


def test_megatron_fsdp_flags_that_change_numbers_are_checked():
    assert configs(["--use-megatron-fsdp", "--megatron-fsdp-grad-comm-dtype", "bf16"]).zero.grad_reduce_dtype == "bf16"
    with pytest.raises(
        ConfigError, match="--zero-stage=2: --data-parallel-sharding-strategy=optim_grads_params is stage 3"
    ):
        configs(["--use-megatron-fsdp", "--zero-stage", "2"])
    with pytest.raises(ConfigError, match="--megatron-fsdp-grad-comm-dtype='fp16': not supported by moezero"):
        configs(["--megatron-fsdp-grad-comm-dtype", "fp16"])
    with pytest.raises(ConfigError, match="--megatron-fsdp-grad-comm-dtype='bf16': needs --use-megatron-fsdp"):
        configs(["--bf16", "--megatron-fsdp-grad-comm-dtype", "bf16"])  # Megatron reads it only there
    assert configs(["--expert-tensor-parallel-size", "2"]).parallel.expert_tensor_parallel == 2
    assert configs(["--expert-tensor-parallel-size", "1"]).parallel.expert_tensor_parallel_size == 1


def test_lr_warmup_init_is_where_warmup_starts():
    t = TrainConfig(global_batch_size=8, train_iters=100, lr=1.0, lr_warmup_iters=10, lr_warmup_init=0.5)
    lr = LearningRateSchedule.from_config(t).lr
    assert lr(0) == 0.5 and lr(8) == pytest.approx(0.5 + 0.5 * 0.1) and lr(80) == 1.0


def test_older_and_pass_through_megatron_flags_of_its_example_scripts():
    """Flags Megatron-LM's example scripts pass (gpt-oss, Qwen3-MoE RL configs): --use-rotary-position-embeddings
    is RoPE (Megatron's validate_args); --no-use-tokenizer-model-from-checkpoint-args keeps the checkpoint's
    tokenizer files out of --use-checkpoint-args; --accumulate-allreduce-grads-in-fp32 with bf16 main grads is
    refused as Megatron asserts; the accepted ones parse."""
    from moezero.config import ZeroConfig
    from moezero.training.resume import ResumePoint, apply_checkpoint_args

    tiny = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"]
    assert configs(tiny + ["--use-rotary-position-embeddings"]).model.position_embedding_type == "rope"
    assert configs(
        tiny
        + [
            "--accumulate-allreduce-grads-in-fp32",
            "--disable-bf16-reduced-precision-matmul",
            "--te-rng-tracker",
            "--ckpt-fully-parallel-save",
            "--ckpt-fully-parallel-load",
            "--cross-entropy-fusion-impl",
            "te",
        ]
    ).zero.accumulate_allreduce_grads_in_fp32
    with pytest.raises(ConfigError, match="--accumulate-allreduce-grads-in-fp32=True: --main-grads-dtype can only"):
        ZeroConfig(accumulate_allreduce_grads_in_fp32=True, use_precision_aware_optimizer=True, main_grads_dtype="bf16")
    saved = {"model": {}, "data": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "/ckpt/tok"}}
    point = ResumePoint("x", 1, saved, {})
    args = tiny + ["--use-checkpoint-args", "--load", "x"]
    assert apply_checkpoint_args(configs(args), point, print).data.tokenizer_model == "/ckpt/tok"
    with pytest.raises(ConfigError, match="HuggingFaceTokenizer needs --tokenizer-model"):  # not the checkpoint's
        apply_checkpoint_args(configs(args + ["--no-use-tokenizer-model-from-checkpoint-args"]), point, print)


def test_flags_of_megatrons_moe_readme_and_fsdp_scripts_are_taken():
    """Flags megatron-core's MoE README and Megatron-FSDP DeepSeek-V3 scripts pass that change no number here are
    taken, with Megatron core_v0.16.1's rules between them (each refusal below is one of its asserts)."""
    from moezero.training.configs import validate
    from tests.integration.pretrain_utils import TINY

    for accepted in (
        [
            "--moe-token-dispatcher-type",
            "flex",
            "--moe-enable-deepep",
            "--moe-router-fusion",
            "--fine-grained-activation-offloading",
            "--offload-modules",
            "expert_fc1",
            "moe_act",
            "--num-distributed-optimizer-instances",
            "2",
            "--ddp-num-buckets",
            "4",
            "--ddp-average-in-collective",
            "--disable-gloo-process-groups",
            "--moe-upcycling-granularity",
            "1",
        ],
        ["--moe-pad-expert-input-to-capacity"],
        ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
        ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"],
        ["--use-distributed-optimizer", "--overlap-param-gather", "--overlap-param-gather-with-optimizer-step"],
    ):
        validate(configs(TINY + accepted), world_size=1)
    no_capacity = [a for a in TINY if a not in ("--moe-expert-capacity-factor", "1.5")]
    for argv, needle in (
        (no_capacity + ["--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
        (TINY + ["--moe-enable-deepep"], "--moe-enable-deepep: needs --moe-token-dispatcher-type flex"),
        (
            TINY + ["--moe-token-dispatcher-type", "flex", "--moe-pad-expert-input-to-capacity"],
            "not with the flex dispatcher's deepep backend",
        ),
        (TINY + ["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor: only with --use-megatron-fsdp"),
        (TINY + ["--optimizer-cpu-offload"], "only with --use-precision-aware-optimizer"),
        (TINY + ["--overlap-param-gather-with-optimizer-step"], "needs --use-distributed-optimizer and"),
        (TINY + ["--megatron-fsdp-main-grads-dtype", "bf16"], "--megatron-fsdp-main-grads-dtype=bf16: needs --bf16"),
    ):
        with pytest.raises(ConfigError, match=needle):
            validate(configs(argv), world_size=1)
