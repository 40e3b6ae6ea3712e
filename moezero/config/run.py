"""The run's layout configs: ranks (ParallelConfig), the ZeRO optimizer (ZeroConfig) and the data (DataConfig)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Collection, Dict, List, Optional, Tuple

from moezero.config.options import ConfigError, Validated, flag_of, option


@dataclass
class ParallelConfig(Validated):
    """How ranks are laid out."""

    section = "parallel"
    expert_parallel_size: int = option(
        1, "ranks that share one copy of the experts (all-to-all group)", flag="--expert-model-parallel-size"
    )
    # Megatron's other parallelisms: accepted at 1 so launch scripts run unchanged
    tensor_parallel_size: int = option(
        1,
        "ranks holding shards of one model replica (Megatron's tensor parallelism: attention heads, MLP columns and "
        "the vocabulary split; with pipeline stages and context parallelism too)",
        flag="--tensor-model-parallel-size",
    )
    pipeline_parallel_size: int = option(
        1,
        "pipeline stages the layers are split over (Megatron's; 1F1B at ZeRO stages 0 and 1, see docs/megatron.md)",
        flag="--pipeline-model-parallel-size",
    )
    # Megatron's other pipeline flags, its defaults; moezero.pipeline.PipelinePlan applies Megatron's rules to them
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "layers per virtual pipeline stage (interleaved schedule)", flag="--num-layers-per-virtual-pipeline-stage"
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None,
        "virtual pipeline stages per pipeline rank (interleaved schedule)",
        flag="--num-virtual-stages-per-pipeline-rank",
    )
    decoder_first_pipeline_num_layers: Optional[int] = option(
        None, "layers of the first pipeline stage (the rest split evenly)", flag="--decoder-first-pipeline-num-layers"
    )
    decoder_last_pipeline_num_layers: Optional[int] = option(
        None, "layers of the last pipeline stage (the rest split evenly)", flag="--decoder-last-pipeline-num-layers"
    )
    pipeline_model_parallel_layout: Optional[str] = option(
        None,
        "each stage's layers as Megatron's layout string (E embedding, t layer, m MTP, L loss, | between stages)",
        flag="--pipeline-model-parallel-layout",
    )
    account_for_embedding_in_pipeline_split: bool = option(
        False,
        "the embedding counts as a layer of the first stage in the even split",
        flag="--account-for-embedding-in-pipeline-split",
    )
    account_for_loss_in_pipeline_split: bool = option(
        False,
        "the loss counts as a layer of the last stage in the even split",
        flag="--account-for-loss-in-pipeline-split",
    )
    no_overlap_p2p_communication: bool = option(
        False,
        "Megatron's: no overlap of the stage-to-stage sends (then virtual stages need "
        "--pipeline-model-parallel-size > 2)",
        flag="--no-overlap-p2p-communication",
    )
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int] = option(
        None,
        "micro-batches per group of the interleaved schedule (default --pipeline-model-parallel-size)",
        flag="--microbatch-group-size-per-virtual-pipeline-stage",
    )
    use_tp_pp_dp_mapping: bool = option(
        False, "Megatron's rank order tp-pp-dp instead of tp-dp-pp", flag="--use-tp-pp-dp-mapping"
    )
    context_parallel_size: int = option(
        1,
        "ranks sharing each sequence (Megatron's context parallelism: chunks r and 2cp-1-r of 2cp each)",
        flag="--context-parallel-size",
    )
    cp_comm_type: List[str] = option(
        help="context parallelism's attention exchange, one for all layers or one per layer: all_gather (of keys "
        "and values), a2a (Ulysses: heads for sequence), p2p (runs all_gather here: the same numbers; its ring "
        "overlaps only on GPUs); a2a+p2p is not supported",
        flag="--cp-comm-type",
        nargs="+",
        default_factory=lambda: ["p2p"],
        choices=("p2p", "all_gather", "a2a", "a2a+p2p"),
    )
    expert_tensor_parallel_size: Optional[int] = option(
        None,
        "ranks splitting each expert's ffn (Megatron's expert tensor parallelism; default: "
        "--tensor-model-parallel-size)",
        flag="--expert-tensor-parallel-size",
    )
    distributed_backend: str = option(
        "nccl",
        "collectives backend (nccl on a machine without CUDA runs gloo, and says so)",
        flag="--distributed-backend",
        choices=("nccl", "gloo"),
    )

    def __post_init__(self):
        self._check_all_choices()
        self._require(self.expert_parallel_size >= 1, "expert_parallel_size", "must be >= 1")
        self._require(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        self._require(self.context_parallel_size >= 1, "context_parallel_size", "must be >= 1")
        self._require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        self._require(
            self.expert_tensor_parallel_size is None or self.expert_tensor_parallel_size >= 1,
            "expert_tensor_parallel_size",
            "must be >= 1",
        )
        refused = self._context_parallel_refusals()
        if refused:  # last: the rest of the section is valid without them
            lines = [f"{flag_of(self, name)}={getattr(self, name)!r}: {why}" for name, why in refused]
            raise ConfigError("\n".join(lines), refused=tuple(name for name, _ in refused))

    @property
    def expert_tensor_parallel(self) -> int:
        """The experts' tensor-parallel size: --expert-tensor-parallel-size, by default (Megatron's) the tp size."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_parallel_size if etp is None else etp

    def _context_parallel_refusals(self) -> List[Tuple[str, str]]:
        """(field, why) of the context-parallel flags and values moezero does not run."""
        refused = []
        if "a2a+p2p" in self.cp_comm_type:
            refused.append(
                ("cp_comm_type", "not supported by moezero: a2a+p2p (hierarchical cp); p2p, all_gather and a2a run")
            )
        return refused


FSDP_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}  # Megatron-FSDP -> ZeRO


@dataclass
class ZeroConfig(Validated):
    """The ZeRO optimizer wrapper and mixed precision."""

    section = "zero"
    stage: Optional[int] = option(
        None,
        "0 = data parallel, 1 = sharded optimizer state, 2 = + sharded gradients, "
        "3 = + sharded params (default 2, or 1 with --use-distributed-optimizer; with "
        "--pipeline-model-parallel-size > 1: 0, or 1 with it, as Megatron's)",
        flag="--zero-stage",
        choices=(0, 1, 2, 3),
    )
    use_distributed_optimizer: bool = option(
        False,
        "Megatron's distributed optimizer: ZeRO-1 unless --zero-stage says otherwise",
        flag="--use-distributed-optimizer",
    )
    use_megatron_fsdp: bool = option(
        False, "Megatron-FSDP: the ZeRO stage its --data-parallel-sharding-strategy names", flag="--use-megatron-fsdp"
    )
    data_parallel_sharding_strategy: str = option(
        "optim_grads_params",
        "with --use-megatron-fsdp: what is sharded (no_shard, optim, optim_grads, "
        "optim_grads_params = ZeRO stage 0, 1, 2, 3)",
        flag="--data-parallel-sharding-strategy",
        choices=tuple(FSDP_STAGES),
    )
    megatron_fsdp_grad_comm_dtype: str = option(
        "auto",
        "Megatron-FSDP's gradient reduction dtype (auto: --grad-reduce-dtype's)",
        flag="--megatron-fsdp-grad-comm-dtype",
        choices=("fp32", "fp16", "bf16", "auto"),
    )
    bucket_size: int = option(2_000_000, "elements per gradient bucket", flag="--ddp-bucket-size")
    min_unit_params: int = option(
        100_000,
        "stage 3: consecutive layers are gathered together until their params "
        "(their experts aside) reach this; layers that all together fall short of it "
        "are gathered with the model's root, once per step (0: every layer alone)",
        flag="--zero-min-unit-params",
    )
    overlap_comm: bool = option(True, "reduce buckets during backward", flag="--overlap-grad-reduce")
    grad_reduce_dtype: str = option(
        "fp32", "dtype gradients are reduced in", flag="--grad-reduce-dtype", choices=("fp32", "bf16", "fp64")
    )
    grad_reduce_in_bf16: bool = option(False, "Megatron's: --grad-reduce-dtype bf16", flag="--grad-reduce-in-bf16")
    accumulate_allreduce_grads_in_fp32: bool = option(
        False,
        "accepted: bf16 gradients are accumulated and reduced "
        "in fp32 anyway (Megatron sets this for bf16) unless "
        "--grad-reduce-in-bf16",
        flag="--accumulate-allreduce-grads-in-fp32",
    )
    use_precision_aware_optimizer: bool = option(
        False,
        "Adam keeps its master weights and moments in the dtypes "
        "below (moezero's PrecisionAwareAdam, Megatron's meaning)",
        flag="--use-precision-aware-optimizer",
    )
    main_grads_dtype: str = option(
        "fp32",
        "with --use-precision-aware-optimizer: the dtype gradients are accumulated, reduced and handed to Adam in",
        choices=("fp32", "bf16"),
    )
    main_params_dtype: str = option(
        "fp32",
        "with --use-precision-aware-optimizer: the master weights' dtype "
        "(fp32 of bf16 params: only the 16 low bits are stored)",
        choices=("fp32", "fp16"),
    )
    exp_avg_dtype: str = option(
        "fp32",
        "with --use-precision-aware-optimizer: Adam's first moment's storage dtype (fp16/fp8 with a per-tensor scale)",
        choices=("fp32", "fp16", "bf16", "fp8"),
    )
    exp_avg_sq_dtype: str = option(
        "fp32",
        "with --use-precision-aware-optimizer: Adam's second moment's storage dtype",
        choices=("fp32", "fp16", "bf16", "fp8"),
    )
    clip_grad: float = option(1.0, "clip the global grad norm to this (0 = off)", flag="--clip-grad")
    max_skipped_steps: int = option(
        20,
        "fail after this many non-finite steps in a row (fp16: at "
        "--min-loss-scale; its overflows above it back the scale off, as Megatron's)",
        flag="--max-consecutive-skipped-steps",
    )
    initial_loss_scale: float = option(2.0**32, "fp16 initial dynamic loss scale", flag="--initial-loss-scale")
    min_loss_scale: float = option(1.0, "fp16 minimum loss scale", flag="--min-loss-scale")
    loss_scale_window: int = option(
        1000, "fp16 steps without overflow before the scale doubles", flag="--loss-scale-window"
    )
    hysteresis: int = option(2, "fp16 overflows tolerated before the scale halves", flag="--hysteresis")

    def __post_init__(self):
        self._check_all_choices()
        fsdp_stage = FSDP_STAGES[self.data_parallel_sharding_strategy] if self.use_megatron_fsdp else None
        self._require(
            self.stage is None or fsdp_stage in (None, self.stage),
            "stage",
            f"--data-parallel-sharding-strategy={self.data_parallel_sharding_strategy} is stage {fsdp_stage}",
        )
        if self.stage is None:
            self.stage = fsdp_stage if fsdp_stage is not None else 1 if self.use_distributed_optimizer else 2
        self._require(
            self.megatron_fsdp_grad_comm_dtype != "fp16",
            "megatron_fsdp_grad_comm_dtype",
            "not supported by moezero (fp32, bf16 or auto)",
        )
        if self.megatron_fsdp_grad_comm_dtype != "auto":  # Megatron reads it in its FSDP adapter only
            self._require(
                self.use_megatron_fsdp,
                "megatron_fsdp_grad_comm_dtype",
                "needs --use-megatron-fsdp (Megatron reads it only there); --grad-reduce-dtype sets the "
                "reduction dtype otherwise",
            )
            self.grad_reduce_dtype = self.megatron_fsdp_grad_comm_dtype
        if self.grad_reduce_in_bf16:
            self._require(
                self.grad_reduce_dtype in ("fp32", "bf16"),
                "grad_reduce_in_bf16",
                f"contradicts --grad-reduce-dtype {self.grad_reduce_dtype}",
            )
            self.grad_reduce_dtype = "bf16"
        if self.accumulate_allreduce_grads_in_fp32 and self.use_precision_aware_optimizer:  # Megatron's assert
            self._require(
                self.main_grads_dtype == "fp32",
                "accumulate_allreduce_grads_in_fp32",
                "--main-grads-dtype can only be fp32 with it",
            )
        self._check_precision_aware()
        self._require(self.bucket_size >= 1, "bucket_size", "must be >= 1")
        self._require(self.min_unit_params >= 0, "min_unit_params", "must be >= 0")
        self._require(self.clip_grad >= 0, "clip_grad", "must be >= 0")
        self._require(self.max_skipped_steps >= 1, "max_skipped_steps", "must be >= 1")
        self._require(self.initial_loss_scale > 0, "initial_loss_scale", "must be > 0")
        self._require(self.min_loss_scale > 0, "min_loss_scale", "must be > 0")
        self._require(self.loss_scale_window >= 1, "loss_scale_window", "must be >= 1")
        self._require(self.hysteresis >= 1, "hysteresis", "must be >= 1")

    def resolve_pipeline_stage(self, pipeline_parallel_size: int, typed: Collection[str]) -> Optional[str]:
        """The stage of a run with pipeline stages when --zero-stage was not typed (`typed`: the command line's
        'section.field's): Megatron runs such a line with its DDP, or with --use-distributed-optimizer its
        distributed optimizer, i.e. ZeRO stage 0 or 1 (the same numbers), where moezero's default without a
        pipeline is 2 (not run with pipeline stages). Returns the notice saying so, None where nothing changed
        (Megatron-FSDP's strategy names its stage itself)."""
        if pipeline_parallel_size == 1 or "zero.stage" in typed or self.use_megatron_fsdp:
            return None
        stage = 1 if self.use_distributed_optimizer else 0
        if self.stage == stage:
            return None
        self.stage = stage
        return (
            f"--pipeline-model-parallel-size={pipeline_parallel_size} without --zero-stage: ZeRO stage {stage} "
            "(Megatron's data parallel; give --use-distributed-optimizer for stage 1)"
        )

    def _check_precision_aware(self) -> None:
        """Megatron's rules: narrow dtypes only with the precision-aware optimizer; bf16 main grads are reduced in
        bf16 (Megatron then leaves --accumulate-allreduce-grads-in-fp32 off)."""
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            self._require(
                getattr(self, name) == "fp32" or self.use_precision_aware_optimizer,
                name,
                "can only be fp32 without --use-precision-aware-optimizer",
            )
        if self.main_grads_dtype == "bf16":
            self._require(
                self.grad_reduce_dtype in ("fp32", "bf16"),
                "main_grads_dtype",
                f"bf16 contradicts --grad-reduce-dtype {self.grad_reduce_dtype}",
            )
            self.grad_reduce_dtype = "bf16"


# the data flags that decide the tokenizer (what a tool rebuilding a run's tokenizer takes from its checkpoint)
TOKENIZER_FIELDS = (
    "tokenizer_type",
    "tokenizer_model",
    "vocab_file",
    "merge_file",
    "vocab_size",
    "tiktoken_pattern",
    "tiktoken_num_special_tokens",
)


def run_tokenizer_fields(saved: Dict[str, Any], typed: Dict[str, Any]) -> Dict[str, Any]:
    """A run's tokenizer fields (`saved`: its stored data section) with the ones a tool's command line types laid
    over them; a typed --tokenizer-type other than the run's takes none of the run's (its files, its sizes)."""
    run = {name: value for name, value in saved.items() if name in TOKENIZER_FIELDS}
    if typed.get("tokenizer_type") not in (None, run.get("tokenizer_type")):
        run = {}
    return {**run, **{name: value for name, value in typed.items() if name in TOKENIZER_FIELDS}}


@dataclass
class DataConfig(Validated):
    """Training data: Megatron indexed datasets, or the built-in standard-library corpus."""

    section = "data"
    data_path: Optional[List[str]] = option(
        None,
        "dataset prefix(es) '[w1] p1 [w2] p2 ...' of .bin/.idx files, "
        "as words or one quoted string (default: the Python standard "
        "library tokenized into a cache)",
        flag="--data-path",
        nargs="*",
    )
    split: str = option("969,30,1", "train,valid,test split weights", flag="--split")
    mock_data: bool = option(
        False,
        "Megatron's synthetic data (megatron-core's MockGPTDataset) instead of --data-path, for benchmarks",
        flag="--mock-data",
    )
    tokenizer_type: str = option(
        "ByteLevelTokenizer",
        "tokenizer",
        flag="--tokenizer-type",
        choices=(
            "ByteLevelTokenizer",
            "GPT2BPETokenizer",
            "HuggingFaceTokenizer",
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "TikTokenizer",
            "NullTokenizer",
        ),
        defines_model=True,
    )
    tokenizer_model: Optional[str] = option(
        None,
        "local HuggingFace tokenizer (tokenizer.json or its folder), a "
        "SentencePiece tokenizer.model (the SentencePiece types), or a tiktoken "
        "vocabulary .json (TikTokenizer)",
        flag="--tokenizer-model",
    )
    vocab_size: Optional[int] = option(
        None,
        "NullTokenizer's size (before its end-of-document token); "
        "TikTokenizer's whole vocabulary (default 131072); with another tokenizer, "
        "a floor",
        flag="--vocab-size",
    )
    tiktoken_pattern: Optional[str] = option(
        None,
        "TikTokenizer's split pattern (default v2; ignored by the other tokenizers, as in Megatron)",
        flag="--tiktoken-pattern",
        choices=("v1", "v2"),
    )
    tiktoken_num_special_tokens: int = option(
        1000, "TikTokenizer: ids below this are special tokens", flag="--tiktoken-num-special-tokens"
    )
    vocab_file: Optional[str] = option(None, "GPT-2 BPE vocabulary (vocab.json)", flag="--vocab-file")
    merge_file: Optional[str] = option(None, "GPT-2 BPE merges (merges.txt)", flag="--merge-file")
    data_cache_path: Optional[str] = option(
        None, "where dataset indices and the default corpus are cached", flag="--data-cache-path"
    )
    default_corpus_max_files: int = option(
        400, "files of the standard library in the default corpus", flag="--default-corpus-max-files"
    )
    eod_mask_loss: bool = option(
        False, "no loss on the end-of-document tokens (megatron-core's GPT dataset masks them)", flag="--eod-mask-loss"
    )
    num_workers: int = option(
        2,
        "processes that read micro-batches ahead of the step that uses them (0: read in the training process)",
        flag="--num-workers",
    )

    def __post_init__(self):
        self._check_all_choices()
        if self.data_path is not None:  # Megatron's words ($DATA_BLEND unquoted), or one string of them
            words = [self.data_path] if isinstance(self.data_path, str) else self.data_path
            self.data_path = [part for word in words for part in word.split()]
            self._require(bool(self.data_path), "data_path", "no dataset prefix given")
        parts = [p.strip() for p in re.split("[,/]", self.split)]
        self.split = ",".join(parts)  # Megatron accepts "," and "/"; everything downstream reads commas
        try:
            weights = self.split_weights if len(parts) <= 3 else ()
        except ValueError:
            weights = ()
        self._require(
            bool(weights) and all(w >= 0 for w in weights) and sum(weights) > 0,
            "split",
            "must be up to three non-negative weights like 969,30,1",
        )
        if self.tokenizer_type not in ("ByteLevelTokenizer", "GPT2BPETokenizer", "NullTokenizer"):
            self._require(
                self.tokenizer_model is not None,
                "tokenizer_type",
                f"{self.tokenizer_type} needs --tokenizer-model (a local path)",
            )
        if self.tokenizer_type == "NullTokenizer":
            self._require(self.vocab_size is not None, "tokenizer_type", "NullTokenizer needs --vocab-size")
        if self.vocab_size is not None:
            self._require(self.vocab_size >= 1, "vocab_size", "must be >= 1")
        self._require(self.num_workers >= 0, "num_workers", "must be >= 0")
        self._require(not (self.mock_data and self.data_path), "mock_data", "replaces --data-path: give one of them")
        bpe = self.tokenizer_type == "GPT2BPETokenizer"
        for name in ("vocab_file", "merge_file"):
            if bpe:
                self._require(
                    getattr(self, name) is not None,
                    "tokenizer_type",
                    "GPT2BPETokenizer needs --vocab-file and --merge-file",
                )
            else:
                self._require(getattr(self, name) is None, name, "only --tokenizer-type GPT2BPETokenizer reads it")
        for name in ("tokenizer_model", "vocab_file", "merge_file"):  # stored in checkpoints: any cwd reads them
            if getattr(self, name) is not None:
                setattr(self, name, os.path.abspath(getattr(self, name)))
        self._require(self.default_corpus_max_files >= 1, "default_corpus_max_files", "must be >= 1")

    @property
    def split_weights(self) -> Tuple[float, float, float]:
        """(train, valid, test) weights of --split; missing trailing ones are 0, as in Megatron."""
        weights = [float(p) for p in self.split.split(",")]
        return tuple(weights + [0.0] * (3 - len(weights)))
