"""Megatron's rank layout with every dimension: tensor (tp), context (cp), expert (ep), expert-tensor (etp), data (dp)
and pipeline (pp) parallelism, as pure partitions of the world (no processes).

Megatron-LM orders ranks 'tp-cp-ep-dp-pp' (the first name fastest), or 'tp-cp-ep-pp-dp' with --use-tp-pp-dp-mapping,
and megatron-core's initialize_model_parallel folds that order twice over the same ranks (parallel_state.py,
RankGenerator and generate_masked_orthogonal_rank_groups):

  decoder (dense params): tp, cp, ep = 1, dp = world / (tp x cp x pp), pp
  expert (routed experts): tp = etp (default tp), ep, dp = world / (etp x ep x pp), pp, cp = 1 (cp folds into dp)

A group of a combined kind ('dp-cp', 'tp-ep') holds the ranks whose coordinates differ only on those axes, the first
axis of the order fastest. For world 8, tp 2, cp 2, ep 2, etp 2:

  tp {0,1} {2,3} {4,5} {6,7}   cp {0,2} {1,3} {4,6} {5,7}   dp {0,4} {1,5} {2,6} {3,7}   dp-cp {0,2,4,6} {1,3,5,7}
  expert: etp = tp,  ep {0,2} {1,3} {4,6} {5,7},  edp {0,4} {1,5} {2,6} {3,7}

Which group carries what (Megatron's use): tp the tensor-parallel collectives, cp the attention's K/V exchange,
dp-cp the dense gradients, tp-cp the router's token counts, tp-dp-cp the global aux loss, etp / ep / tp-ep / edp the
experts' (edp: their gradients), pp the pipeline, and per pp group its embedding ranks (first and last) and
position-embedding rank (first).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from moezero.config.options import ConfigError

Ranks = Tuple[int, ...]
Partition = Tuple[Ranks, ...]
DECODER_KINDS = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-dp", "tp-pp", "tp-cp-pp")
EXPERT_KINDS = ("tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp")


@dataclass(frozen=True)
class MegatronRankLayout:
    """Every group of every kind, as Megatron builds them; `decoder[kind]` and `expert[kind]` are partitions of the
    world (the expert kinds name etp 'tp' and edp 'dp', as megatron-core's expert RankGenerator does)."""

    world_size: int
    tensor_parallel_size: int
    context_parallel_size: int
    expert_parallel_size: int
    expert_tensor_parallel_size: int
    pipeline_parallel_size: int
    use_tp_pp_dp_mapping: bool
    decoder: Dict[str, Partition]
    expert: Dict[str, Partition]
    embedding_groups: Partition  # per pp group: its first and last rank (one rank at pp 1)
    position_embedding_groups: Partition  # per pp group: its first rank

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read distinct micro-batches."""
        return self.world_size // (self.tensor_parallel_size * self.context_parallel_size * self.pipeline_parallel_size)

    @property
    def expert_data_parallel_size(self) -> int:
        return self.world_size // (
            self.expert_tensor_parallel_size * self.expert_parallel_size * self.pipeline_parallel_size
        )

    @staticmethod
    def group_of(partition: Partition, rank: int) -> Ranks:
        return next(group for group in partition if rank in group)

    def coordinate(self, kind: str, rank: int, expert: bool = False) -> int:
        """This rank's place in its group of `kind` (decoder's, or the experts' with `expert`)."""
        return self.group_of((self.expert if expert else self.decoder)[kind], rank).index(rank)


def megatron_rank_layout(
    world_size: int,
    tensor_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    pipeline_parallel_size: int = 1,
    use_tp_pp_dp_mapping: bool = False,
) -> MegatronRankLayout:
    """Every partition of Megatron's two foldings; its refusals as one-line ConfigErrors naming the flags."""
    tp, cp, ep, pp = tensor_parallel_size, context_parallel_size, expert_parallel_size, pipeline_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size  # Megatron's default
    check_sizes(world_size, tp, cp, ep, etp, pp, use_tp_pp_dp_mapping)
    order = ("tp", "cp", "ep", "pp", "dp") if use_tp_pp_dp_mapping else ("tp", "cp", "ep", "dp", "pp")
    decoder_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": world_size // (tp * cp * pp), "pp": pp}
    expert_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": world_size // (etp * ep * pp), "pp": pp}
    decoder = {kind: masked_groups(order, decoder_sizes, kind.split("-")) for kind in DECODER_KINDS}
    expert = {kind: masked_groups(order, expert_sizes, kind.split("-")) for kind in EXPERT_KINDS}
    return MegatronRankLayout(
        world_size,
        tp,
        cp,
        ep,
        etp,
        pp,
        use_tp_pp_dp_mapping,
        decoder,
        expert,
        embedding_groups=tuple(_first_and_last(group) for group in decoder["pp"]),
        position_embedding_groups=tuple(group[:1] for group in decoder["pp"]),
    )


def check_sizes(world: int, tp: int, cp: int, ep: int, etp: int, pp: int, use_tp_pp_dp_mapping: bool) -> None:
    """initialize_model_parallel's refusals (parallel_state.py, core_v0.16.1), each a ConfigError naming the flags."""
    for flag, value in (
        ("--tensor-model-parallel-size", tp),
        ("--context-parallel-size", cp),
        ("--expert-model-parallel-size", ep),
        ("--expert-tensor-parallel-size", etp),
        ("--pipeline-model-parallel-size", pp),
    ):
        if value < 1:
            raise ConfigError(f"{flag}={value}: must be >= 1")
    if world < 1:
        raise ConfigError(f"world size {world}: must be >= 1")
    decoder = (("--tensor-model-parallel-size", tp), ("--context-parallel-size", cp))
    expert = (("--expert-tensor-parallel-size", etp), ("--expert-model-parallel-size", ep))
    pipeline = (("--pipeline-model-parallel-size", pp),)
    if world % (tp * cp * pp):  # parallel_state.py:740
        raise ConfigError(f"{_product(decoder + pipeline)} must divide the world size ({world})")
    if world % (etp * ep * pp):  # parallel_state.py:792
        raise ConfigError(f"{_product(expert + pipeline)} must divide the world size ({world})")
    if use_tp_pp_dp_mapping and pp > 1 and world // (etp * ep * pp) != world // (tp * cp * pp):
        # parallel_state.py:808: without pp last in the order, the experts' data parallel size must be the decoder's
        named = ", ".join(f"{flag}={value}" for flag, value in expert + decoder + pipeline if value > 1)
        raise ConfigError(
            f"--use-tp-pp-dp-mapping, {named}: Megatron's tp-pp-dp rank order with a pipeline needs the experts' "
            f"data-parallel size (world / (etp x ep x pp) = {world // (etp * ep * pp)}) to equal the decoder's "
            f"(world / (tp x cp x pp) = {world // (tp * cp * pp)})"
        )


def _product(sizes: Sequence[Tuple[str, int]]) -> str:
    """'--a=2, --b=4: their product (8)' over the sizes above 1 (or '--a=3:' for one of them)."""
    named = [(flag, value) for flag, value in sizes if value > 1] or list(sizes[-1:])
    flags = ", ".join(f"{flag}={value}" for flag, value in named)
    if len(named) == 1:
        return f"{flags}:"
    total = 1
    for _, value in named:
        total *= value
    return f"{flags}: their product ({total})"


def masked_groups(order: Sequence[str], sizes: Dict[str, int], axes: Sequence[str]) -> Partition:
    """generate_masked_orthogonal_rank_groups: rank = sum of coordinate x stride over `order` (the first name
    fastest); one group per setting of the other coordinates (the first of them fastest), its ranks ordered by the
    masked coordinates (the first of them fastest)."""
    shape = [sizes[name] for name in order]
    strides = [1]
    for size in shape[:-1]:
        strides.append(strides[-1] * size)
    inside = [i for i, name in enumerate(order) if name in axes]
    outside = [i for i in range(len(order)) if i not in inside]

    def ranks(base: int, dims) -> Tuple[int, ...]:
        # itertools.product varies its last range fastest: feed the dims reversed so the first of them is fastest
        return tuple(
            base + sum(c * strides[i] for c, i in zip(setting, reversed(dims)))
            for setting in itertools.product(*(range(shape[i]) for i in reversed(dims)))
        )

    return tuple(ranks(base, inside) for base in ranks(0, outside))


def _first_and_last(group: Ranks) -> Ranks:
    return group[:1] if len(group) == 1 else (group[0], group[-1])
