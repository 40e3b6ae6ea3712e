"""The MoE layers' config (MoEConfig): routing, load balancing, capacity, shared experts; a GPT fills in its
width, activation and init (model.moe_layer_config)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

from moezero.config.options import Validated, option

BALANCING_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")  # Megatron's load-balancing loss types
BALANCING_TYPES = BALANCING_LOSSES + ("sinkhorn", "none")


@dataclass
class MoEConfig(Validated):
    """One MoE layer: router, dispatcher and experts (Megatron-Core flag names).

    Each field with a flag is that flag of the MoEConfig table of the [flag reference](flags.md#moeconfig) (its
    type, default and meaning there). The fields without one are filled in from the GPT's config by a training
    run; an MoE layer built alone takes them as given.

    Attributes:
        hidden_size: the model width (a run's --hidden-size).
        activation: the experts' activation, one of gelu, gelu_tanh, swiglu, quick_geglu (a GPT's
            mlp_activation()).
        glu_linear_offset: a gated activation's offset of the up projection (a GPT's --glu-linear-offset).
        activation_clamp: a gated activation's clamp (a GPT's --activation-func-clamp-value).
        bias: biases in the experts, router and shared expert (None: a GPT's --disable-bias-linear decides; a
            layer built alone has none).
        init_std: the std of the normal init (a run's --init-method-std).
        init_seed: the seed of the layout-invariant init (a run's --seed).
    """

    section = "moe"
    hidden_size: int = option(64, "model width (taken from --hidden-size)", flag=None)
    ffn_hidden_size: Optional[int] = option(
        None,
        "expert FFN width (default: the dense --ffn-hidden-size)",
        flag="--moe-ffn-hidden-size",
        defines_model=True,
        derived_when_none=True,
    )
    num_experts: Optional[int] = option(
        None, "number of routed experts (default: none, a dense model)", flag="--num-experts", defines_model=True
    )
    top_k: int = option(2, "experts per token", flag="--moe-router-topk", defines_model=True)
    score_function: str = option(
        "softmax",
        "router score function",
        flag="--moe-router-score-function",
        choices=("softmax", "sigmoid"),
        defines_model=True,
    )
    pre_softmax: bool = option(
        False,
        "softmax over all experts before top-k (no top-k renormalisation)",
        flag="--moe-router-pre-softmax",
        defines_model=True,
    )
    topk_scaling_factor: Optional[float] = option(
        None, "scale applied to the top-k weights", flag="--moe-router-topk-scaling-factor", defines_model=True
    )
    num_groups: Optional[int] = option(
        None,
        "group-limited routing: experts form this many groups (DeepSeek's n_group)",
        flag="--moe-router-num-groups",
        defines_model=True,
    )
    group_topk: Optional[int] = option(
        None,
        "group-limited routing: tokens choose experts among this many groups (topk_group)",
        flag="--moe-router-group-topk",
        defines_model=True,
    )
    group_score: str = option(
        "top_sum",
        "how a group is scored: the sum of its top --moe-router-topk / "
        "--moe-router-group-topk experts (Megatron), of its two best whatever the top-k "
        "(transformers' DeepSeek-V3), or its best expert (DeepSeek-V2)",
        flag="--moe-router-group-score",
        choices=("top_sum", "top2_sum", "max"),
        defines_model=True,
    )
    load_balancing_type: Union[str, List[str]] = option(
        "aux_loss",
        "load balancing: the aux loss over each micro-batch, each sequence or the global batch (all "
        "data-parallel ranks and micro-batches), sinkhorn routing, or none; several losses at once as a list",
        flag="--moe-router-load-balancing-type",
        choices=BALANCING_TYPES,
        nargs="+",
    )
    aux_loss_coeff: Union[float, List[float]] = option(
        0.0,
        "load-balancing aux loss coefficient (one per --moe-router-load-balancing-type)",
        flag="--moe-aux-loss-coeff",
        nargs="+",
    )
    force_load_balancing: bool = option(
        False,
        "benchmarks: route by random logits (an even load in expectation) "
        "with the real logits' gradients, as Megatron's straight-through",
        flag="--moe-router-force-load-balancing",
    )
    z_loss_coeff: Optional[float] = option(None, "router z-loss coefficient", flag="--moe-z-loss-coeff")
    capacity_factor: Optional[float] = option(
        None, "expert capacity factor; None = dropless", flag="--moe-expert-capacity-factor"
    )
    token_drop_policy: str = option(
        "probs",
        "which assignments an over-capacity expert keeps: torch.topk's picks "
        "of the routing probabilities, or of the routing map (its ties: the device's "
        "choice), over Megatron's sequence-major tokens",
        flag="--moe-token-drop-policy",
        choices=("probs", "position"),
    )
    input_jitter_eps: Optional[float] = option(
        None,
        "multiplicative uniform jitter on the router's input, in every forward (evaluation too, as Megatron's)",
        flag="--moe-input-jitter-eps",
    )
    enable_expert_bias: bool = option(
        False,
        "aux-loss-free load balancing with a per-expert routing bias",
        flag="--moe-router-enable-expert-bias",
        defines_model=True,
    )
    bias_update_rate: float = option(
        1e-3, "expert bias update rate per optimizer step", flag="--moe-router-bias-update-rate"
    )
    shared_expert_intermediate_size: Optional[int] = option(
        None,
        "FFN width of the shared expert(s) every token passes through",
        flag="--moe-shared-expert-intermediate-size",
        defines_model=True,
    )
    shared_expert_gate: bool = option(
        False,
        "scale the shared expert's output by a learned sigmoid gate of the token (Qwen2-MoE)",
        flag="--moe-shared-expert-gate",
        defines_model=True,
    )
    activation: str = option(
        "gelu",
        "expert activation (a GPT's mlp_activation())",
        flag=None,
        choices=("gelu", "gelu_tanh", "swiglu", "quick_geglu"),
    )
    glu_linear_offset: float = option(
        0.0, "a gated activation's offset of the up projection (a GPT's --glu-linear-offset)", flag=None
    )
    activation_clamp: Optional[float] = option(
        None, "a gated activation's clamp (a GPT's --activation-func-clamp-value)", flag=None
    )
    bias: Optional[bool] = option(
        None,
        "biases in the experts, router and shared expert (none: a GPT's "
        "--disable-bias-linear decides; a layer built alone has none)",
        flag=None,
        defines_model=True,
        derived_when_none=True,
    )
    router_dtype: Optional[str] = option(
        None,
        "router logits and scores in fp32 or fp64 (default: the input's dtype, at least fp32)",
        flag="--moe-router-dtype",
        choices=("fp32", "fp64"),
    )
    grouped_gemm: bool = option(
        True, "run local experts as one grouped GEMM (else a per-expert loop)", flag="--moe-grouped-gemm"
    )
    pad_expert_rows: bool = option(
        True,
        "on CPUs, pad each local expert's rows with zero rows to a size class (at "
        "most a quarter more), so a run meets a few GEMM shapes, not new ones every "
        "step: oneDNN caches a primitive per shape (bf16 held far more memory without "
        "it); the numbers are unchanged. moezero's own flag",
        flag="--moe-pad-expert-rows",
    )
    delay_wgrad_compute: bool = option(
        False,
        "the routed experts' weight gradients in a backward node of their "
        "own, after the rows' all-to-all back is launched (with --overlap-moe-"
        "expert-parallel-comm; the same numbers)",
        flag="--delay-wgrad-compute",
    )
    use_upcycling: bool = option(
        False,
        "start from the dense checkpoint of --load: every expert a copy of its "
        "layer's dense MLP, the routers new (the logits start as the dense model's)",
        flag="--moe-use-upcycling",
    )
    init_std: float = option(0.02, "std of the normal init (taken from --init-method-std)", flag=None)
    init_seed: int = option(0, "seed of the layout-invariant init (taken from --seed)", flag=None)

    def __post_init__(self):
        self._load_balancing_lists()
        self._check_all_choices()
        self._require(self.hidden_size >= 1, "hidden_size", "must be >= 1")
        if self.ffn_hidden_size is not None:  # None: derived (a GPT's dense width, else 4 * hidden)
            self._require(self.ffn_hidden_size >= 1, "ffn_hidden_size", "must be >= 1")
        if self.num_experts is not None:
            self._require(self.num_experts >= 1, "num_experts", "must be >= 1")
            self._require(
                1 <= self.top_k <= self.num_experts,
                "top_k",
                f"must be between 1 and --num-experts ({self.num_experts})",
            )
        if self.capacity_factor is not None and self.capacity_factor < 0:  # Megatron's spelling of dropless
            self.capacity_factor = None
        if self.capacity_factor is not None:
            self._require(
                self.capacity_factor > 0 and math.isfinite(self.capacity_factor),
                "capacity_factor",
                "must be > 0 (or unset, or negative, for dropless routing)",
            )
        coefficients = self.aux_loss_coeff if isinstance(self.aux_loss_coeff, list) else [self.aux_loss_coeff]
        self._require(all(c >= 0 for c in coefficients), "aux_loss_coeff", "must be >= 0")
        self._require(
            self.load_balancing_type != "sinkhorn" or not self.aux_loss_coeff,
            "aux_loss_coeff",
            "--moe-router-load-balancing-type sinkhorn balances by routing: no aux loss (Megatron's rule)",
        )
        if self.load_balancing_type == "sinkhorn":  # its routing ignores these (Megatron's too): refused, not lost
            self._require(
                not (self.enable_expert_bias or self.num_groups or self.pre_softmax),
                "load_balancing_type",
                "sinkhorn routing has no expert bias, group limit or pre-softmax",
            )
        if self.z_loss_coeff is not None:
            self._require(self.z_loss_coeff >= 0, "z_loss_coeff", "must be >= 0")
        if self.input_jitter_eps is not None:
            self._require(0 < self.input_jitter_eps < 1, "input_jitter_eps", "must be in (0, 1)")
        if self.shared_expert_intermediate_size is not None:
            self._require(self.shared_expert_intermediate_size >= 1, "shared_expert_intermediate_size", "must be >= 1")
        self._require(self.bias_update_rate >= 0, "bias_update_rate", "must be >= 0")
        if self.num_groups is not None and self.num_experts is not None:
            self._require(
                self.num_groups >= 1 and self.num_experts % self.num_groups == 0,
                "num_groups",
                f"must divide --num-experts ({self.num_experts})",
            )
            self._require(
                self.group_topk is not None and 1 <= self.group_topk <= self.num_groups,
                "group_topk",
                f"group-limited routing needs it between 1 and --moe-router-num-groups ({self.num_groups})",
            )
            self._require(
                self.top_k <= self.group_topk * (self.num_experts // self.num_groups),
                "top_k",
                "more experts than the chosen groups hold",
            )
            if self.group_score == "top_sum":
                self._require(
                    self.top_k % self.group_topk == 0,
                    "group_topk",
                    f"must divide --moe-router-topk ({self.top_k}) to score groups by their top experts",
                )
            if self.group_score == "top2_sum":
                self._require(
                    self.num_experts // self.num_groups >= 2,
                    "num_groups",
                    "must leave two experts per group to score groups by their two best",
                )
        self._require(
            not self.shared_expert_gate or self.shared_expert_intermediate_size is not None,
            "shared_expert_gate",
            "needs --moe-shared-expert-intermediate-size",
        )

    def _load_balancing_lists(self) -> None:
        """Megatron's lists (nargs '+'): one item is that item (its validate_args), several are several losses
        with a coefficient each."""
        for name in ("load_balancing_type", "aux_loss_coeff"):
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                setattr(self, name, value[0] if len(value) == 1 else list(value))
        if isinstance(self.load_balancing_type, list):
            self._require(
                isinstance(self.aux_loss_coeff, list) and len(self.aux_loss_coeff) == len(self.load_balancing_type),
                "aux_loss_coeff",
                "one --moe-aux-loss-coeff per --moe-router-load-balancing-type (Megatron's rule)",
            )
            self._require(
                set(self.load_balancing_type) <= set(BALANCING_LOSSES),
                "load_balancing_type",
                f"a list holds losses: {', '.join(BALANCING_LOSSES)}",
            )
        else:
            self._require(
                not isinstance(self.aux_loss_coeff, list),
                "aux_loss_coeff",
                "one --moe-aux-loss-coeff per --moe-router-load-balancing-type (Megatron's rule)",
            )

    def balancing_coefficients(self) -> Dict[str, float]:
        """{load-balancing loss type: coefficient} of the losses that are on (coefficient > 0)."""
        types, coefficients = self.load_balancing_type, self.aux_loss_coeff
        if not isinstance(types, list):
            types, coefficients = [types], [coefficients]
        return {t: c for t, c in zip(types, coefficients) if t in BALANCING_LOSSES and c > 0}
