"""The GPT decoder's config (GPTConfig), the layer patterns, and how it combines with the MoE layers'
(config/moe.py)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from moezero.config.moe import MoEConfig
from moezero.config.options import ConfigError, Validated, flag_of, option


def moe_layer_pattern(text: Any) -> Union[int, List[int]]:
    """--moe-layer-freq as Megatron reads it: "N", or a list expression of 0/1 per layer, e.g. "([0]*1+[1]*3)"."""
    if isinstance(text, (int, list)):
        return text
    if "[" not in text:
        return int(text)
    if re.search(r"[^,\d\[\]()+* ]", text):  # Megatron's rule: digits, brackets, commas, + and * only
        raise ValueError(f"not a list expression of digits, [ ] ( ) , + *: {text}")
    value = eval(text, {"__builtins__": {}})  # nothing but literals and + * can reach here
    if not isinstance(value, list):
        raise ValueError(f"not a list: {text}")
    return value


def int_pair(text: Any) -> Tuple[int, int]:
    """Megatron's tuple type: "128,0" -> (128, 0)."""
    if isinstance(text, (tuple, list)):
        return tuple(int(v) for v in text)
    values = tuple(int(v) for v in str(text).strip("()[] ").split(","))
    if len(values) != 2:
        raise ValueError(f"two integers L,R: {text}")
    return values


def is_window_layer(layer_number: int, config: "GPTConfig") -> bool:
    """Whether layer `layer_number` (from 0; an MTP depth's layer numbered on from the last) attends in a sliding
    window: Megatron's is_layer_window_attention, which counts layers from 1."""
    if not config.window_size:
        return False
    freq = config.window_attn_skip_freq
    if freq is None:
        return True
    if isinstance(freq, int):
        return (layer_number + 1) % freq != 0
    return bool(freq[layer_number])


def is_moe_layer(layer_number: int, moe_layer_freq: Union[int, List[int]]) -> bool:
    """Megatron's pattern: N means layers 0, N, 2N, ... (1: all of them); a list says it per layer."""
    if isinstance(moe_layer_freq, int):
        return layer_number % moe_layer_freq == 0
    return moe_layer_freq[layer_number] == 1


# Megatron's --recompute-modules choices (megatron-core's TransformerConfig)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
RECOMPUTE_KEPT = ("moe_act", "shared_experts", "mla_up_proj")  # accepted; moezero keeps them in memory


@dataclass
class GPTConfig(Validated):
    """The GPT decoder."""

    section = "model"
    num_layers: int = option(4, "transformer layers", flag="--num-layers", defines_model=True)
    hidden_size: int = option(128, "model width", flag="--hidden-size", defines_model=True)
    num_attention_heads: int = option(4, "attention heads", flag="--num-attention-heads", defines_model=True)
    ffn_hidden_size: Optional[int] = option(
        None,
        "dense MLP width (default 4 * hidden)",
        flag="--ffn-hidden-size",
        defines_model=True,
        derived_when_none=True,
    )
    seq_length: int = option(256, "tokens per sample", flag="--seq-length")
    max_position_embeddings: Optional[int] = option(
        None,
        "learned position table size (default --seq-length)",
        flag="--max-position-embeddings",
        defines_model=True,
        derived_when_none=True,
    )
    vocab_size: Optional[int] = option(
        None,
        "the model's vocabulary (filled in by the training script: the "
        "tokenizer's, padded to --make-vocab-size-divisible-by)",
        flag=None,
        defines_model=True,
        derived_when_none=True,
    )
    make_vocab_size_divisible_by: int = option(
        128, "pad the vocabulary to a multiple of this", flag="--make-vocab-size-divisible-by"
    )
    position_embedding_type: str = option(
        "learned_absolute",
        "position encoding (none: no positions, NoPE)",
        flag="--position-embedding-type",
        choices=("learned_absolute", "rope", "none"),
        defines_model=True,
    )
    no_position_embedding: bool = option(
        False,
        "Megatron's older switch for no learned position table: only with "
        "rope, where it changes nothing (Megatron refuses it otherwise)",
        flag="--no-position-embedding",
    )
    use_rotary_position_embeddings: bool = option(
        False, "Megatron's older switch for --position-embedding-type rope", flag="--use-rotary-position-embeddings"
    )
    rotary_base: float = option(10000.0, "RoPE base", flag="--rotary-base", defines_model=True)
    rotary_percent: float = option(
        1.0,
        "share of each head's dimensions RoPE rotates (the first ones)",
        flag="--rotary-percent",
        defines_model=True,
    )
    group_query_attention: bool = option(
        False,
        "grouped-query attention: --num-query-groups key/value heads",
        flag="--group-query-attention",
        defines_model=True,
    )
    num_query_groups: int = option(
        1,
        "key/value heads with --group-query-attention (without it, as in Megatron, "
        "ignored: every query head has its own)",
        flag="--num-query-groups",
        defines_model=True,
    )
    kv_channels: Optional[int] = option(
        None,
        "width of each attention head (default --hidden-size / --num-attention-heads)",
        flag="--kv-channels",
        defines_model=True,
        derived_when_none=True,
    )
    add_qkv_bias: bool = option(
        False,
        "biases on the query/key/value projection even with --disable-bias-linear",
        flag="--add-qkv-bias",
        defines_model=True,
    )
    qk_layernorm: bool = option(
        False,
        "normalise queries and keys (--normalization's norm) before RoPE",
        flag="--qk-layernorm",
        defines_model=True,
    )
    qk_layernorm_scope: str = option(
        "head",
        "with --qk-layernorm: each head on its own (Megatron, Qwen3) or all heads' width at once (OLMoE)",
        flag="--qk-layernorm-scope",
        choices=("head", "full_width"),
        defines_model=True,
    )
    norm_epsilon: float = option(1e-5, "epsilon of every norm layer", flag="--norm-epsilon", defines_model=True)
    softmax_type: str = option(
        "vanilla",
        "attention softmax: vanilla; off-by-one (exp(0) more in each "
        "denominator); learnable (a learned logit per head in each denominator, GPT-OSS's "
        "attention sinks)",
        flag="--softmax-type",
        choices=("vanilla", "off-by-one", "learnable"),
        defines_model=True,
    )
    window_size: Optional[Tuple[int, int]] = option(
        None,
        "sliding-window attention as Megatron's L,R: a query sees itself and the L keys before it (R, the "
        "keys after it, must be 0 in a causal model)",
        flag="--window-size",
        parse=int_pair,
        defines_model=True,
    )
    window_attn_skip_freq: Optional[Union[int, List[int]]] = option(
        None,
        "with --window-size: N makes every N-th layer (N, 2N, ... counting from 1) full attention; or a list "
        "expression as --moe-layer-freq's, 1 for each windowed layer",
        flag="--window-attn-skip-freq",
        parse=moe_layer_pattern,
        defines_model=True,
    )
    multi_latent_attention: bool = option(
        False,
        "DeepSeek's multi-latent attention (MLA) instead of --kv-channels heads",
        flag="--multi-latent-attention",
        defines_model=True,
    )
    q_lora_rank: Optional[int] = option(
        None,
        "MLA: the queries' latent width (default: no latent, one projection)",
        flag="--q-lora-rank",
        defines_model=True,
    )
    kv_lora_rank: int = option(32, "MLA: the keys' and values' latent width", flag="--kv-lora-rank", defines_model=True)
    qk_head_dim: int = option(
        128, "MLA: each head's query/key width without positions", flag="--qk-head-dim", defines_model=True
    )
    qk_pos_emb_head_dim: int = option(
        64,
        "MLA: each head's query/key width that RoPE rotates (the key part is shared by all heads)",
        flag="--qk-pos-emb-head-dim",
        defines_model=True,
    )
    v_head_dim: int = option(128, "MLA: each head's value width", flag="--v-head-dim", defines_model=True)
    rope_type: Optional[str] = option(
        None,
        "rope, or yarn: YaRN's context extension (--rotary-scaling-factor, "
        "--mscale, --mscale-all-dim, --yarn-*). Default as Megatron's: yarn with "
        "--multi-latent-attention (MLATransformerConfig's), else rope",
        flag="--rope-type",
        choices=("rope", "yarn"),
        defines_model=True,
        derived_when_none=True,
    )
    rotary_seq_len_interpolation_factor: Optional[int] = option(
        None,
        "linear position interpolation: RoPE sees each position divided by this (Megatron applies it to "
        "standard attention's RoPE only)",
        flag="--rotary-seq-len-interpolation-factor",
        defines_model=True,
    )
    rotary_scaling_factor: float = option(
        1.0, "YaRN: the context extension factor", flag="--rotary-scaling-factor", defines_model=True
    )
    mscale: float = option(1.0, "YaRN: mscale of the cos/sin scale", flag="--mscale", defines_model=True)
    mscale_all_dim: float = option(
        0.0, "YaRN: mscale_all_dim (also MLA's softmax scale)", flag="--mscale-all-dim", defines_model=True
    )
    yarn_original_max_position_embeddings: Optional[int] = option(
        None,
        "YaRN: the context length before extension (default 4096, Megatron's)",
        flag="--yarn-original-max-position-embeddings",
        defines_model=True,
        derived_when_none=True,
    )
    yarn_beta_fast: Optional[float] = option(
        None, "YaRN: beta_fast (default 32)", flag="--yarn-beta-fast", defines_model=True, derived_when_none=True
    )
    yarn_beta_slow: Optional[float] = option(
        None, "YaRN: beta_slow (default 1)", flag="--yarn-beta-slow", defines_model=True, derived_when_none=True
    )
    no_yarn_correction_range_round_to_int: bool = option(
        False,
        "YaRN: keep the ends of the ramp between beta_fast and beta_slow fractional (GPT-OSS's; transformers' "
        "truncate false)",
        flag="--no-yarn-correction-range-round-to-int",
        defines_model=True,
    )
    untie_embeddings_and_output_weights: bool = option(
        False,
        "separate output layer instead of tied embeddings",
        flag="--untie-embeddings-and-output-weights",
        defines_model=True,
    )
    normalization: str = option(
        "LayerNorm", "norm layer", flag="--normalization", choices=("LayerNorm", "RMSNorm"), defines_model=True
    )
    apply_layernorm_1p: bool = option(
        False,
        "zero-centred norm weights: each norm scales by 1 + its weight, which "
        "starts at 0 (Megatron's layernorm_zero_centered_gamma)",
        flag="--apply-layernorm-1p",
        defines_model=True,
    )
    swiglu: bool = option(
        False,
        "SwiGLU MLPs and experts instead of GELU (default width int(8h/3/64)*64)",
        flag="--swiglu",
        defines_model=True,
    )
    quick_geglu: bool = option(
        False,
        "quick-GELU gated MLPs and experts (GPT-OSS's): x*sigmoid(1.702x) of the gate "
        "times the up projection (default width 4h, as Megatron's)",
        flag="--quick-geglu",
        defines_model=True,
    )
    glu_linear_offset: float = option(
        0.0, "gated MLPs and experts: act(gate) * (up + this)", flag="--glu-linear-offset", defines_model=True
    )
    activation_func_clamp_value: Optional[float] = option(
        None,
        "gated MLPs and experts: the gate clamped above at this value and the up projection to +-it before "
        "the product (GPT-OSS's 7)",
        flag="--activation-func-clamp-value",
        defines_model=True,
    )
    disable_bias_linear: bool = option(
        False,
        "no biases in the linear layers (attention, MLPs, experts, router)",
        flag="--disable-bias-linear",
        defines_model=True,
    )
    no_bias_gelu_fusion: bool = option(
        False,
        "the exact (erf) GELU. Without it the MLPs and experts with biases and GELU use Megatron's fused "
        "bias-GELU, the tanh approximation, as Megatron's dense MLPs do by default (Megatron refuses its fused "
        "GELU in MoE layers, so its MoE scripts with GELU and biases give this flag)",
        flag="--no-bias-gelu-fusion",
        defines_model=True,
    )
    hidden_dropout: float = option(0.1, "dropout on residual branches", flag="--hidden-dropout")
    attention_dropout: float = option(0.1, "dropout on attention probabilities", flag="--attention-dropout")
    init_method_std: float = option(0.02, "std of the normal init", flag="--init-method-std")
    moe_layer_freq: Union[int, List[int]] = option(
        1,
        "N: layers 0, N, 2N, ... have an MoE MLP (1 = all); or Megatron's list expression, one 0/1 per layer, "
        'e.g. "([0]*1+[1]*3)"',
        flag="--moe-layer-freq",
        defines_model=True,
        parse=moe_layer_pattern,
    )
    recompute_activations: bool = option(
        False,
        "recompute the core attention in backward (Megatron's --recompute-granularity selective)",
        flag="--recompute-activations",
    )
    recompute_granularity: Optional[str] = option(
        None,
        "full: recompute whole layers (see --recompute-method); selective: only the core attention",
        flag="--recompute-granularity",
        choices=("full", "selective"),
    )
    recompute_method: Optional[str] = option(
        None,
        "with full: uniform recomputes chunks of --recompute-num-layers "
        "layers, block the first --recompute-num-layers layers one by one",
        flag="--recompute-method",
        choices=("uniform", "block"),
    )
    recompute_num_layers: Optional[int] = option(
        None, "layers per chunk (uniform) or layers recomputed (block)", flag="--recompute-num-layers"
    )
    recompute_modules: Optional[List[str]] = option(
        None,
        "with --recompute-granularity selective, the parts recomputed in backward (Megatron's; default "
        "core_attn): core_attn, mlp (dense MLPs), moe (MoE layers), layernorm (the layers' norms); moe_act, "
        "shared_experts and mla_up_proj are accepted and kept in memory (the numbers are the same)",
        flag="--recompute-modules",
        choices=RECOMPUTE_MODULES,
        nargs="+",
    )
    moe_layer_recompute: bool = option(False, "recompute each MoE layer in backward", flag="--moe-layer-recompute")
    mtp_num_layers: Optional[int] = option(
        None,
        "multi-token prediction (DeepSeek-V3's, Megatron's): this many modules after the last layer, the k-th "
        "predicting the token k+1 places further on; each has the last layer's kind of MLP and shares the "
        "embedding and output layer",
        flag="--mtp-num-layers",
        defines_model=True,
    )
    mtp_loss_scaling_factor: float = option(
        0.1, "weight of the MTP losses' mean in the training loss", flag="--mtp-loss-scaling-factor"
    )
    cross_entropy_loss_fusion: bool = option(
        False,
        "the token cross-entropy in one fused pass per row and one for its gradient (CPU kernel, fp32 math "
        "from bf16 or fp32 logits, without their fp32 copy); the loss agrees with the unfused one to ~1e-6, not "
        "bitwise",
        flag="--cross-entropy-loss-fusion",
    )
    apply_query_key_layer_scaling: bool = option(
        False,
        "Megatron's fp16 safeguard: layer L's (from 1) attention scores are computed as q k^T * scale / L in "
        "the model's dtype and multiplied back by L in fp32 before the fp32 softmax (the same in exact "
        "arithmetic)",
        flag="--apply-query-key-layer-scaling",
    )

    def __post_init__(self):
        self._check_all_choices()
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "make_vocab_size_divisible_by"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        if isinstance(self.moe_layer_freq, int):
            self._require(self.moe_layer_freq >= 1, "moe_layer_freq", "must be >= 1")
        else:
            self._require(
                len(self.moe_layer_freq) == self.num_layers and set(self.moe_layer_freq) <= {0, 1},
                "moe_layer_freq",
                f"a list needs one 0 or 1 per layer ({self.num_layers})",
            )
        if self.use_rotary_position_embeddings:  # Megatron's validate_args, whatever the type says
            self.position_embedding_type = "rope"
        if self.no_position_embedding and self.position_embedding_type == "learned_absolute":  # stored before the
            # command line refused it (check_command_line): no table
            self.position_embedding_type = "none"
        self._check_attention()
        self._check_gated()
        self._check_windows()
        if self.gated or self.disable_bias_linear:  # no GELU with biases: the flag decides nothing, and one value
            self.no_bias_gelu_fusion = True  # lets a resume compare models, not spellings (as Megatron's
            # validate_args does without biases)
        if self.ffn_hidden_size is None:  # Megatron's widths: 4h, or 2/3 of it rounded down to 64 for SwiGLU
            self.ffn_hidden_size = int(8 * self.hidden_size / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size
            self._require(
                self.ffn_hidden_size >= 1,
                "ffn_hidden_size",
                f"--swiglu's default width int(8h/3/64)*64 is 0 for --hidden-size {self.hidden_size}: give it",
            )
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        self._require(
            self.max_position_embeddings >= self.seq_length,
            "max_position_embeddings",
            f"must be >= --seq-length ({self.seq_length})",
        )
        for name in ("hidden_dropout", "attention_dropout"):
            self._require(0.0 <= getattr(self, name) < 1.0, name, "must be in [0, 1)")
        self._check_recompute()
        self._check_multi_token_prediction()

    @property
    def gated(self) -> bool:
        """Gated MLPs and experts (SwiGLU, quick GEGLU): their input projection holds [gate | up]."""
        return self.swiglu or self.quick_geglu

    def _check_gated(self) -> None:
        self._require(not (self.swiglu and self.quick_geglu), "quick_geglu", "not with --swiglu (one activation)")
        if not self.gated:
            self._require(self.glu_linear_offset == 0.0, "glu_linear_offset", "needs --swiglu or --quick-geglu")
            self._require(
                self.activation_func_clamp_value is None,
                "activation_func_clamp_value",
                "needs --swiglu or --quick-geglu",
            )
        elif self.activation_func_clamp_value is not None:
            self._require(self.activation_func_clamp_value > 0, "activation_func_clamp_value", "must be > 0")

    def _check_windows(self) -> None:
        if self.window_size is not None:
            self._require(
                self.window_size[0] >= 0 and self.window_size[1] == 0,
                "window_size",
                "L,R with L >= 0 and R = 0 (a causal model sees no key after its query)",
            )
        else:
            self._require(self.window_attn_skip_freq is None, "window_attn_skip_freq", "needs --window-size")
        if isinstance(self.window_attn_skip_freq, int):
            self._require(self.window_attn_skip_freq >= 1, "window_attn_skip_freq", "must be >= 1")
        elif self.window_attn_skip_freq is not None:
            self._require(
                len(self.window_attn_skip_freq) == self.num_layers and set(self.window_attn_skip_freq) <= {0, 1},
                "window_attn_skip_freq",
                f"a list needs one 0 or 1 per layer ({self.num_layers})",
            )
            self._require(
                not self.mtp_num_layers,
                "window_attn_skip_freq",
                "a list names no MTP depth's layer (Megatron indexes it by layer): give N, or no MTP",
            )

    def mlp_activation(self) -> str:
        """The activation of every MLP and expert. Megatron (arguments.py, argument_utils.py, mlp.py):
        --bias-gelu-fusion is on unless --no-bias-gelu-fusion or --disable-bias-linear, and then a biased GELU
        MLP runs bias_gelu_impl, the tanh-approximated GELU. (Its MoE layers refuse that: MLP.forward raises
        with per-token scales. One GELU for the whole model keeps --moe-use-upcycling exact.)"""
        if self.swiglu:
            return "swiglu"
        if self.quick_geglu:
            return "quick_geglu"
        return "gelu" if self.no_bias_gelu_fusion else "gelu_tanh"  # set by --disable-bias-linear too

    def _check_attention(self) -> None:
        """Head width, key/value groups and the rotated share (Megatron's rules)."""
        if self.kv_channels is None:
            self._require(
                self.hidden_size % self.num_attention_heads == 0,
                "hidden_size",
                f"must be divisible by --num-attention-heads ({self.num_attention_heads}), or give --kv-channels",
            )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        self._require(self.kv_channels >= 1, "kv_channels", "must be >= 1")
        if self.group_query_attention:
            self._require(
                self.num_query_groups >= 1 and self.num_attention_heads % self.num_query_groups == 0,
                "num_query_groups",
                f"must divide --num-attention-heads ({self.num_attention_heads})",
            )
        self._require(0.0 < self.rotary_percent <= 1.0, "rotary_percent", "must be in (0, 1]")
        self._check_latent_attention()
        self._check_position_interpolation()
        self._require(self.norm_epsilon > 0, "norm_epsilon", "must be > 0")
        if self.position_embedding_type == "rope":
            self._require(
                self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
                "rotary_percent",
                f"rope needs an even number of rotated dimensions (--kv-channels {self.kv_channels} x "
                f"--rotary-percent {self.rotary_percent} = {self.kv_channels * self.rotary_percent:g})",
            )

    def _check_latent_attention(self) -> None:
        if self.rope_type is None:  # Megatron pops an unset --rope-type, so MLATransformerConfig's default wins
            self.rope_type = "yarn" if self.multi_latent_attention else "rope"
        if self.rope_type == "yarn":  # Megatron's MLA defaults
            self.yarn_original_max_position_embeddings = self.yarn_original_max_position_embeddings or 4096
            self.yarn_beta_fast = 32.0 if self.yarn_beta_fast is None else self.yarn_beta_fast
            self.yarn_beta_slow = 1.0 if self.yarn_beta_slow is None else self.yarn_beta_slow
            self._require(self.rotary_scaling_factor >= 1.0, "rotary_scaling_factor", "must be >= 1")
        if not self.multi_latent_attention:
            return
        self._require(not self.group_query_attention, "group_query_attention", "not with --multi-latent-attention")
        self._require(
            self.softmax_type == "vanilla" and self.window_size is None,
            "multi_latent_attention",
            "not with --softmax-type or --window-size (moezero has them for standard attention)",
        )
        self._require(self.q_lora_rank is None or self.q_lora_rank >= 1, "q_lora_rank", "must be >= 1")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(
            self.qk_pos_emb_head_dim >= 2 and self.qk_pos_emb_head_dim % 2 == 0,
            "qk_pos_emb_head_dim",
            "must be even and >= 2",
        )

    def _check_position_interpolation(self) -> None:
        factor = self.rotary_seq_len_interpolation_factor
        if factor is None:
            return
        self._require(factor >= 1, "rotary_seq_len_interpolation_factor", "must be >= 1")
        self._require(
            self.position_embedding_type == "rope" and not self.multi_latent_attention,
            "rotary_seq_len_interpolation_factor",
            "Megatron applies it only to standard attention's "
            "RoPE (--position-embedding-type rope without --multi-latent-attention); drop it",
        )

    # MLATransformerConfig's YaRN fields that no Megatron flag reaches (its --yarn-* flags have other names)
    MLA_YARN = {"yarn_original_max_position_embeddings": 4096, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}

    @classmethod
    def check_command_line(cls, values: Dict[str, Any]) -> None:
        """Megatron's reading of a command line where it differs from the config's: its multi-latent attention
        takes MLA_YARN whatever --yarn-* say, so a value that differs would train another model than Megatron
        does with the same script; likewise where Megatron's MLA scales its rotary embedding or softmax otherwise
        than moezero's (which follows transformers' DeepSeek there), and --rope-type yarn on standard attention,
        which Megatron refuses. (Hugging Face configs set these fields, and mean them.)"""
        rope = values.get("position_embedding_type") == "rope" or values.get("use_rotary_position_embeddings")
        if values.get("no_position_embedding") and not rope:
            raise ConfigError(
                "--no-position-embedding: Megatron refuses it without rope (validate_args: "
                "'--no-position-embedding is deprecated, use --position-embedding-type'); give "
                "--position-embedding-type none"
            )
        if not values.get("multi_latent_attention"):
            if values.get("rope_type") == "yarn":
                raise ConfigError(
                    "--rope-type=yarn: Megatron's standard attention takes only rope (validate_args "
                    "asserts 'Common attention only support rope_type=\"rope\"'); YaRN comes with "
                    "--multi-latent-attention (a run saved with it resumes without this flag, with "
                    "--use-checkpoint-args)"
                )
            return
        for name, megatrons in cls.MLA_YARN.items():
            if values.get(name) is not None and values[name] != megatrons:
                raise ConfigError(
                    f"{flag_of(cls, name)}={values[name]:g}: Megatron's multi-latent attention does "
                    f"not read it (MLATransformerConfig keeps {megatrons:g}); drop it or give that"
                )
        if values.get("no_yarn_correction_range_round_to_int"):  # its YaRN rounds the correction range
            raise ConfigError(
                f"{flag_of(cls, 'no_yarn_correction_range_round_to_int')}: Megatron's multi-latent "
                "attention does not read it (its YaRN always rounds the correction range); drop it"
            )
        cls._check_mla_scales(values)

    @classmethod
    def _check_mla_scales(cls, values: Dict[str, Any]) -> None:
        """Megatron's MLA scales cos/sin by mscale(f, --mscale) / mscale(f, --mscale-all-dim) whatever is 0, the
        softmax by mscale(f, --mscale-all-dim)^2 also with --rope-type rope, and rotates --rotary-percent of the
        positional dims there; moezero's takes transformers' rules (the ratio only when both are set; the softmax
        factor only under YaRN; every positional dim): a command line where they differ is refused."""
        factor = values.get("rotary_scaling_factor") or 1.0
        mscale, mscale_all_dim = values.get("mscale", 1.0), values.get("mscale_all_dim", 0.0)

        def scale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        rope_type = values.get("rope_type") or "yarn"  # MLATransformerConfig's default
        megatrons = scale(mscale) / scale(mscale_all_dim)
        if rope_type == "yarn" and not (mscale and mscale_all_dim) and megatrons != scale(1.0):
            raise ConfigError(
                f"--mscale={mscale:g} with --mscale-all-dim={mscale_all_dim:g}: Megatron's YaRN scales "
                f"cos/sin by mscale(f, mscale) / mscale(f, mscale_all_dim) = {megatrons:.6g}, moezero's (transformers' "
                "rule when one "
                f"is 0) by {scale(1.0):.6g}; give both nonzero, or --mscale 1 --mscale-all-dim 0"
            )
        if rope_type != "rope":
            return
        if values.get("rotary_percent", 1.0) != 1.0:
            raise ConfigError(
                f"--rotary-percent={values['rotary_percent']:g}: with --rope-type rope Megatron's MLA "
                "rotates that share of --qk-pos-emb-head-dim, moezero's all of it; drop it"
            )
        if scale(mscale_all_dim) != 1.0:
            raise ConfigError(
                f"--rotary-scaling-factor={factor:g} with --mscale-all-dim={mscale_all_dim:g}: "
                "Megatron's MLA scales the softmax by mscale(f, mscale_all_dim)^2 = "
                f"{scale(mscale_all_dim) ** 2:.6g} also with --rope-type rope, moezero's only under "
                "YaRN; drop them or use --rope-type yarn"
            )

    @property
    def query_groups(self) -> int:
        """Key/value heads: --num-query-groups with --group-query-attention, else one per query head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (Megatron: int(kv_channels * rotary_percent))."""
        return int(self.kv_channels * self.rotary_percent)

    def _check_multi_token_prediction(self) -> None:
        """Megatron's rules: 0 layers is none; MTP with positions from RoPE or none (validate_args)."""
        if self.mtp_num_layers == 0:
            self.mtp_num_layers = None
        if self.mtp_num_layers is None:
            return
        self._require(self.mtp_num_layers >= 1, "mtp_num_layers", "must be >= 0")
        self._require(
            self.position_embedding_type in ("rope", "none"),
            "mtp_num_layers",
            f"needs --position-embedding-type rope or none, not {self.position_embedding_type} (Megatron's rule)",
        )
        self._require(self.mtp_loss_scaling_factor >= 0.0, "mtp_loss_scaling_factor", "must be >= 0")

    def _check_recompute(self) -> None:
        """Megatron's rules: --recompute-activations is selective; full needs a method and a layer count."""
        if self.recompute_activations:
            self._require(
                self.recompute_granularity in (None, "selective"),
                "recompute_granularity",
                "--recompute-activations is --recompute-granularity selective",
            )
            self.recompute_granularity = "selective"
        if self.recompute_granularity == "full":
            self._require(
                self.recompute_method is not None,
                "recompute_granularity",
                "full needs --recompute-method uniform or block",
            )
            self._require(
                self.recompute_num_layers is not None and 1 <= self.recompute_num_layers <= self.num_layers,
                "recompute_num_layers",
                f"full needs a count between 1 and --num-layers ({self.num_layers})",
            )
        else:
            self._require(self.recompute_method is None, "recompute_method", "needs --recompute-granularity full")
        if self.recompute_modules and "mla_up_proj" in self.recompute_modules:  # Megatron's check
            self._require(
                self.multi_latent_attention,
                "recompute_modules",
                "mla_up_proj is only supported with --multi-latent-attention",
            )

    def recomputes(self, part: str) -> bool:
        """Whether selective recompute redoes `part` in backward (one of RECOMPUTE_MODULES)."""
        parts = ["core_attn"] if self.recompute_modules is None else self.recompute_modules
        return self.recompute_granularity == "selective" and part in parts


def upgrade_stored_configs(configs: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Configs a checkpoint or export stored before a field existed, as the model they describe:
    - before --disable-bias-linear the attention and dense MLPs had biases and the MoE layers (experts, router,
      shared expert) had none;
    - before --no-bias-gelu-fusion every GELU was the exact one;
    - before --multi-latent-attention meant YaRN by default (Megatron's), an unset --rope-type was plain RoPE."""
    model, moe = configs.get("model"), configs.get("moe")
    if not model or "num_layers" not in model:
        return configs
    out = dict(configs)
    if "disable_bias_linear" not in model:
        out["model"] = model = dict(model, disable_bias_linear=False)
        if moe is not None:
            out["moe"] = dict(moe, bias=False)
    if "no_bias_gelu_fusion" not in model:
        out["model"] = model = dict(model, no_bias_gelu_fusion=True)
    if model.get("rope_type", "rope") is None:  # before MLA's yarn default an unset --rope-type was RoPE
        out["model"] = dict(model, rope_type="rope")
    return out


def expert_ffn_size(moe: MoEConfig) -> int:
    """The experts' FFN width: --moe-ffn-hidden-size, else 4 * hidden (inside a GPT: its dense width)."""
    return moe.ffn_hidden_size or 4 * moe.hidden_size


def moe_layer_config(gpt: GPTConfig, moe: MoEConfig, seed: int) -> MoEConfig:
    """The MoE layers' config inside a GPT: `moe` with the fields the model decides (width, activation, init)."""
    return dataclasses.replace(
        moe,
        hidden_size=gpt.hidden_size,
        ffn_hidden_size=moe.ffn_hidden_size or gpt.ffn_hidden_size,
        activation=gpt.mlp_activation(),
        glu_linear_offset=gpt.glu_linear_offset,
        activation_clamp=gpt.activation_func_clamp_value,
        init_std=gpt.init_method_std,
        init_seed=seed,
        bias=not gpt.disable_bias_linear if moe.bias is None else moe.bias,
    )
