"""Which layers each pipeline stage holds: Megatron's flags, Megatron's meaning, Megatron's refusals (pure).

A `PipelinePlan` is built from the plain values of Megatron's pipeline flags and gives, for every (pipeline rank,
virtual stage), a `StagePiece`. Stage s is virtual stage s // pp of rank s % pp (Megatron's interleaved placement,
torch.distributed.pipelining's "loop" style): 8 layers at pp 2 x vpp 2 -> rank 0 holds [0, 1] [4, 5], rank 1
[2, 3] [6, 7]. Layers are handed out in stage order, each stage taking a count set by one of three regimes
(mutually exclusive, as in megatron-core's get_transformer_layer_offset / get_num_layers_to_build):

- layout: --pipeline-model-parallel-layout names each stage's layers (layout_string.py);
- first/last: --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers on the first / last rank,
  the rest split evenly over the middle ranks, each rank's count split evenly over its virtual stages;
- even: --num-layers (+1 with --account-for-embedding-in-pipeline-split, +1 with
  --account-for-loss-in-pipeline-split) split evenly over pp x vpp stages, the embedding's / loss's slot taken
  from the first / last stage.

Layer numbers are moezero's: global and from 0, as `GPTModel` builds `TransformerLayer(config, mlp, i)` for i in
range(num_layers). megatron-core numbers a stage's i-th layer `layer_number = offset + i + 1` (from 1), where
`offset = get_transformer_layer_offset(...)`; so moezero's layer n is Megatron's layer_number n + 1, and a stage
holds moezero's layers offset .. offset + get_num_layers_to_build(...) - 1. MTP depths are numbered from 0 (moezero
builds depth k's layer as layer num_layers + k).

Where the embedding, the final norm, the head and MTP live (Megatron's): the embedding on stage 0 and the output
head with the loss on the last stage (Megatron's pre_process / post_process: the first and last stage, whatever
empty stages a layout puts before 'E' or after 'L'); the MTP depths where the layout puts 'm', else on the last
stage; the decoder's final norm on the last stage, or, with MTP, on the stage holding the last decoder layer
(TransformerBlock.has_final_layernorm_in_this_stage).

Every rule Megatron applies to these flags is refused here in one line naming the flags and values: Megatron-LM's
validate_args (megatron/training/arguments.py, line numbers of core_v0.16.1 below), megatron-core 0.16.1's
TransformerConfig.__post_init__ (transformer_config.py) and the asserts of get_num_layers_to_build, which Megatron
only reaches when it builds the model. Where Megatron accepts values that build a broken model, moezero refuses too
(each such rule says so); tests/unit/test_pipeline_layout.py checks all of it against megatron-core.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from moezero.config.options import ConfigError
from moezero.pipeline import layout_string

LAYOUT = "layout"
FIRST_LAST = "first/last"
EVEN = "even"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


@dataclass(frozen=True)
class StagePiece:
    """What one (pipeline rank, virtual stage) holds."""

    stage_index: int  # virtual_stage * pp + pp_rank
    pp_rank: int
    virtual_stage: int
    layers: Tuple[int, ...]  # global decoder layer numbers, from 0
    embedding: bool  # the word (and position) embedding: the first stage
    final_norm: bool  # the decoder's final norm
    head: bool  # the output layer and the loss: the last stage
    mtp: Tuple[int, ...]  # MTP depths, from 0

    @property
    def empty(self) -> bool:
        return not (self.layers or self.embedding or self.final_norm or self.head or self.mtp)


@dataclass(frozen=True)
class PipelinePlan:
    """Megatron's pipeline flags (plain values) and, derived from them, every stage's piece; raises ConfigError."""

    num_layers: int
    mtp_num_layers: Optional[int] = None
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    pipeline_model_parallel_layout: Optional[str] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    overlap_p2p_comm: bool = True  # Megatron's default; --no-overlap-p2p-communication clears it
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int] = None  # None: pp (Megatron's default)
    regime: str = field(init=False)
    virtual_stages: int = field(init=False)  # vpp (1 without virtual stages)
    pieces: Tuple[StagePiece, ...] = field(init=False, repr=False)  # by stage index

    def __post_init__(self):
        _check_values(self)
        regime, virtual, layer_counts, mtp_counts = _stage_counts(self)
        if virtual > 1:
            _check_virtual_stages(self.pipeline_model_parallel_size, self.overlap_p2p_comm, virtual)
        object.__setattr__(self, "regime", regime)
        object.__setattr__(self, "virtual_stages", virtual)
        object.__setattr__(
            self,
            "pieces",
            _pieces(self.pipeline_model_parallel_size, self.num_layers, self.mtp_depths, layer_counts, mtp_counts),
        )

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def mtp_depths(self) -> int:
        return self.mtp_num_layers or 0

    @property
    def microbatch_group_size(self) -> int:
        return self.microbatch_group_size_per_virtual_pipeline_stage or self.pp

    def piece(self, pp_rank: int, virtual_stage: int = 0) -> StagePiece:
        return self.pieces[virtual_stage * self.pp + pp_rank]

    def pieces_of(self, pp_rank: int) -> Tuple[StagePiece, ...]:
        """A rank's pieces, by virtual stage."""
        return self.pieces[pp_rank :: self.pp]

    def stage_of_layer(self, layer: int) -> StagePiece:
        return next(piece for piece in self.pieces if layer in piece.layers)

    @property
    def mtp_standalone(self) -> bool:
        """Megatron's mtp_standalone: a layout puts the MTP depths on a rank other than the last."""
        return any(piece.mtp and piece.pp_rank != self.pp - 1 for piece in self.pieces)

    def fingerprint(self) -> int:
        """A number every rank computes alike from the pieces (for agreement records)."""
        text = ";".join(
            f"{p.stage_index}:{p.layers}:{p.embedding:d}{p.final_norm:d}{p.head:d}:{p.mtp}" for p in self.pieces
        )
        return zlib.crc32(f"{self.pp}x{self.virtual_stages}|{text}".encode())

    def check_num_microbatches(self, num_microbatches: int) -> None:
        """Refuse, in one line, a micro-batch count per step that the interleaved schedule cannot take.

        Megatron's interleaved schedule (megatron-core pipeline_parallel/schedules.py:996) runs micro-batches in
        groups of g = --microbatch-group-size-per-virtual-pipeline-stage (default pp): pp <= g <= M, and
        M % g is 0 or >= pp. torch's ScheduleInterleaved1F1B groups M // max(1, M // pp) micro-batches per round
        and needs M divisible by the rounds; a g it cannot run is refused too (with the default g, every M
        Megatron takes is one torch runs with g-sized groups). Without virtual stages any M >= 1 runs (1F1B, or
        all forwards first when M < pp, as Megatron's warm-up does), and g is unused, as in Megatron."""
        m, pp, g = num_microbatches, self.pp, self.microbatch_group_size
        if m < 1:
            raise ConfigError(
                f"{m} micro-batches per step: at least one is needed (--global-batch-size / "
                "(--micro-batch-size x data-parallel size))"
            )
        if self.virtual_stages == 1:
            return
        given = (
            f"{GROUP_FLAG}={g}"
            if self.microbatch_group_size_per_virtual_pipeline_stage
            else f"{GROUP_FLAG} (default --pipeline-model-parallel-size, {g})"
        )
        if not pp <= g <= m:
            raise ConfigError(
                f"{given}: with virtual stages it must range in [--pipeline-model-parallel-size "
                f"({pp}), the micro-batches per step ({m})] (Megatron's interleaved schedule)"
            )
        if 0 < m % g < pp:
            raise ConfigError(
                f"{given}: {m} micro-batches per step leave a last group of {m % g}, fewer than "
                f"--pipeline-model-parallel-size ({pp}) (Megatron's interleaved schedule refuses it)"
            )
        rounds = max(1, m // pp)
        if m % rounds:
            raise ConfigError(
                f"{given}: torch's interleaved schedule cannot split {m} micro-batches per step into "
                f"{rounds} equal rounds (M // pp); use a multiple of --pipeline-model-parallel-size "
                f"({pp}) with the default group size"
            )
        if m // rounds != g:
            raise ConfigError(
                f"{given}: with {m} micro-batches per step torch's interleaved schedule runs groups "
                f"of {m // rounds} (M // max(1, M // pp)); give that group size, or the default with "
                f"a multiple of --pipeline-model-parallel-size ({pp}) micro-batches"
            )

    def check_supported(self) -> None:
        """What the stage execution does not run yet (a limit of moezero, not a Megatron rule): MTP depths on a
        rank other than the last, and a stage that holds nothing at all."""
        layout = f"{layout_string.FLAG}={self.pipeline_model_parallel_layout!r}"
        if self.mtp_standalone:
            piece = next(p for p in self.pieces if p.mtp)
            raise ConfigError(
                f"{layout}: the MTP depths on pipeline rank {piece.pp_rank} (not the last, "
                "Megatron's mtp_standalone) are not supported yet: put 'm' in the last stage"
            )
        empty = [p.stage_index for p in self.pieces if p.empty]
        if empty:
            raise ConfigError(
                f"{layout}: stage {empty[0]} holds nothing (no layer, embedding, MTP or loss): "
                "empty stages are not supported yet"
            )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_values(plan: PipelinePlan) -> None:
    """Plain range checks, then Megatron's rules between the flags that pick a regime."""
    positive = (
        "num_layers",
        "pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        "microbatch_group_size_per_virtual_pipeline_stage",
    )
    for name in positive:
        value = getattr(plan, name)
        if value is not None and value < 1:
            # Megatron: first/last "must be larger than 0" (transformer_config.py:1368, 1387); the others divide
            raise ConfigError(f"{_flag(name)}={value}: must be >= 1")
    if plan.mtp_num_layers is not None and plan.mtp_num_layers < 0:
        raise ConfigError(f"--mtp-num-layers={plan.mtp_num_layers}: must be >= 0")
    virtual_flags = [
        f"{_flag(name)}={getattr(plan, name)!r}"
        for name in (
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "pipeline_model_parallel_layout",
        )
        if getattr(plan, name) is not None
    ]
    if len(virtual_flags) > 1:  # arguments.py:503
        raise ConfigError(f"{', '.join(virtual_flags)}: at most one of these may be given")
    first_last = [
        f"{_flag(name)}={getattr(plan, name)}"
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
        if getattr(plan, name) is not None
    ]
    accounts = [
        _flag(name)
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
        if getattr(plan, name)
    ]
    if plan.pipeline_model_parallel_layout is not None and (first_last or accounts):
        # transformer_config.py:1310 (after 1294 for first/last with account_for, the same refusal)
        raise ConfigError(
            f"{layout_string.FLAG}={plan.pipeline_model_parallel_layout!r}, "
            f"{', '.join(first_last + accounts)}: the layout cannot be combined with them"
        )
    if first_last and plan.num_layers_per_virtual_pipeline_stage is not None:  # arguments.py:530
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage={plan.num_layers_per_virtual_pipeline_stage}, "
            f"{', '.join(first_last)}: with uneven first/last stages give the virtual stages with "
            "--num-virtual-stages-per-pipeline-rank"
        )
    if first_last and accounts:  # transformer_config.py:1294
        raise ConfigError(
            f"{', '.join(first_last + accounts)}: the first/last stage counts cannot be combined with "
            "the embedding/loss accounting"
        )


def _stage_counts(plan: PipelinePlan) -> Tuple[str, int, List[int], List[int]]:
    """(regime, vpp, decoder layers per stage, MTP depths per stage), by stage index."""
    if plan.pipeline_model_parallel_layout is not None:
        return (LAYOUT,) + _layout_counts(plan)
    if plan.decoder_first_pipeline_num_layers is not None or plan.decoder_last_pipeline_num_layers is not None:
        return (FIRST_LAST,) + _first_last_counts(plan)
    return (EVEN,) + _even_counts(plan)


def _mtp_on_last(plan: PipelinePlan, stages: int) -> List[int]:
    """Without a layout, Megatron builds every MTP depth on the last stage (get_mtp_num_layers_to_build)."""
    return [0] * (stages - 1) + [plan.mtp_depths]


def _layout_counts(plan: PipelinePlan) -> Tuple[int, List[int], List[int]]:
    layout = plan.pipeline_model_parallel_layout
    stages = layout_string.parse_layout(layout)
    layout_string.check_layout(layout, stages, plan.pp, plan.num_layers, plan.mtp_depths)
    return len(stages) // plan.pp, [s.count("t") for s in stages], [s.count("m") for s in stages]


def _virtual_from_flags(plan: PipelinePlan, layers_per_rank: Optional[int]) -> int:
    """vpp from --num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage (the latter
    counts the even split's slots per rank, arguments.py:545-550)."""
    if plan.num_virtual_stages_per_pipeline_rank is not None:
        return plan.num_virtual_stages_per_pipeline_rank
    per_stage = plan.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return 1
    if layers_per_rank % per_stage:  # arguments.py:547
        raise ConfigError(
            f"--num-layers-per-virtual-pipeline-stage={per_stage}: must divide the layers per "
            f"pipeline rank ({layers_per_rank}: {_slots_text(plan)} over "
            f"--pipeline-model-parallel-size={plan.pp})"
        )
    return layers_per_rank // per_stage


def _slots_text(plan: PipelinePlan) -> str:
    extra = [
        _flag(name)
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
        if getattr(plan, name)
    ]
    return f"--num-layers={plan.num_layers}" + "".join(f" + 1 for {flag}" for flag in extra)


def _even_counts(plan: PipelinePlan) -> Tuple[int, List[int], List[int]]:
    embedding, loss = int(plan.account_for_embedding_in_pipeline_split), int(plan.account_for_loss_in_pipeline_split)
    slots = plan.num_layers + embedding + loss
    if slots % plan.pp:
        # arguments.py:543, 570; transformer_config.py:1447, 1460; transformer_block.py get_num_layers_to_build
        raise ConfigError(f"{_slots_text(plan)}: must be divisible by --pipeline-model-parallel-size={plan.pp}")
    per_rank = slots // plan.pp
    virtual = _virtual_from_flags(plan, per_rank)
    if per_rank % virtual:  # transformer_config.py:1471; get_num_layers_to_build's assert
        raise ConfigError(
            f"--num-virtual-stages-per-pipeline-rank={virtual}: must divide the layers per pipeline "
            f"rank ({per_rank}: {_slots_text(plan)} over --pipeline-model-parallel-size={plan.pp})"
        )
    per_stage = per_rank // virtual
    counts = [per_stage] * (plan.pp * virtual)
    counts[0] -= embedding  # the embedding's slot: first stage; the loss's: last stage
    counts[-1] -= loss  # (never below 0: a stage has >= 1 slot, and a single stage has both plus the layers)
    return virtual, counts, _mtp_on_last(plan, len(counts))


def _first_last_counts(plan: PipelinePlan) -> Tuple[int, List[int], List[int]]:
    first, last = plan.decoder_first_pipeline_num_layers, plan.decoder_last_pipeline_num_layers
    pp, virtual = plan.pp, _virtual_from_flags(plan, None)
    given = [
        (flag, value)
        for flag, value in (
            ("--decoder-first-pipeline-num-layers", first),
            ("--decoder-last-pipeline-num-layers", last),
        )
        if value is not None
    ]
    if pp == 1:
        # one stage is both first and last: Megatron builds the last count there (else the first), and with both
        # given accepts a last count short of --num-layers (transformer_config.py:1406 then sees -1 middle
        # stages): refused
        flag, value = given[-1]
        if value != plan.num_layers:
            raise ConfigError(
                f"{flag}={value}: with --pipeline-model-parallel-size=1 the one stage holds all "
                f"--num-layers={plan.num_layers}"
            )
        return virtual, [plan.num_layers], _mtp_on_last(plan, 1)
    for flag, value in given:
        if value % virtual:  # transformer_config.py:1372, 1391
            raise ConfigError(
                f"{flag}={value}: must be divisible by the virtual stages per rank "
                f"(--num-virtual-stages-per-pipeline-rank={virtual})"
            )
    middle_layers = plan.num_layers - sum(value for _, value in given)
    middle_ranks = pp - len(given)
    named = ", ".join(f"{flag}={value}" for flag, value in given)
    if middle_layers < 0:
        # Megatron accepts this when middle ranks are left (its middle ranks then build a negative count): refused
        raise ConfigError(f"{named}: more than --num-layers={plan.num_layers}")
    if bool(middle_layers) != bool(middle_ranks):  # transformer_config.py:1406
        raise ConfigError(
            f"{named}: leave {middle_layers} layers of --num-layers={plan.num_layers} for "
            f"{middle_ranks} middle ranks of --pipeline-model-parallel-size={pp}"
        )
    if middle_ranks and middle_layers % middle_ranks:  # transformer_config.py:1414
        raise ConfigError(
            f"{named}: the {middle_layers} other layers of --num-layers={plan.num_layers} must be "
            f"divisible by the {middle_ranks} middle ranks of --pipeline-model-parallel-size={pp}"
        )
    per_middle = middle_layers // middle_ranks if middle_ranks else 0
    if per_middle % virtual:  # transformer_config.py:1422
        raise ConfigError(
            f"{named}: the {per_middle} layers of each middle rank must be divisible by "
            f"--num-virtual-stages-per-pipeline-rank={virtual}"
        )
    per_rank = [per_middle] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    counts = [per_rank[stage % pp] // virtual for stage in range(pp * virtual)]
    return virtual, counts, _mtp_on_last(plan, len(counts))


def _check_virtual_stages(pp: int, overlap_p2p_comm: bool, virtual: int) -> None:
    """arguments.py:573-582: the interleaved schedule needs pp > 1, and pp > 2 without p2p overlap (else one
    batch would carry several sends and receives between the same two ranks)."""
    if overlap_p2p_comm and pp < 2:
        raise ConfigError(f"--pipeline-model-parallel-size={pp}: {virtual} virtual stages per rank need it > 1")
    if not overlap_p2p_comm and pp < 3:
        raise ConfigError(
            f"--pipeline-model-parallel-size={pp}, --no-overlap-p2p-communication: "
            f"{virtual} virtual stages per rank without p2p overlap need it > 2"
        )


def _pieces(
    pp: int, num_layers: int, mtp_depths: int, layer_counts: List[int], mtp_counts: List[int]
) -> Tuple[StagePiece, ...]:
    """Hand out layers (and MTP depths) in stage order, each stage its count."""
    pieces, next_layer, next_depth = [], 0, 0
    last = len(layer_counts) - 1
    for stage, (count, depths) in enumerate(zip(layer_counts, mtp_counts)):
        layers = tuple(range(next_layer, next_layer + count))
        next_layer += count
        holds_last_layer = num_layers - 1 in layers
        final_norm = holds_last_layer if mtp_depths else stage == last
        pieces.append(
            StagePiece(
                stage,
                stage % pp,
                stage // pp,
                layers,
                stage == 0,
                final_norm,
                stage == last,
                tuple(range(next_depth, next_depth + depths)),
            )
        )
        next_depth += depths
    assert next_layer == num_layers and next_depth == mtp_depths, (layer_counts, mtp_counts)
    return tuple(pieces)
