"""Megatron's rank order with a pipeline dimension: the partitions the pipeline builds its
groups from, a view of `parallel/ranks.py`'s `megatron_rank_layout` (pure).

Megatron-LM's initialize.py orders ranks 'tp-cp-ep-dp-pp' (the first name fastest), or 'tp-cp-ep-pp-dp' with
--use-tp-pp-dp-mapping, and megatron-core's initialize_model_parallel folds them twice over the same ranks
(parallel_state.py, RankGenerator:447 and generate_masked_orthogonal_rank_groups:251): the decoder's (dense params)
with ep = 1, dp = world / (cp x pp), and the experts' with ep, edp = world / (ep x pp). At tp = cp = 1:

  world 8, ep 2, pp 2, default order:  dp {0,1,2,3} {4,5,6,7}   pp {0,4} {1,5} {2,6} {3,7}
                                       ep {0,1} {2,3} {4,5} {6,7}   edp {0,2} {1,3} {4,6} {5,7}
  world 8, ep 1, pp 2, tp-pp-dp:       dp {0,2,4,6} {1,3,5,7}   pp {0,1} {2,3} {4,5} {6,7}

With context parallelism (cp > 1) the dense params reduce over Megatron's dp-cp group (a stage's ranks) and the
experts fold cp into edp; a stage's cp ranks share each micro-batch:

  world 4, cp 2, pp 2, default order:  cp {0,1} {2,3}   dp-cp {0,1} {2,3}   dp {0} {1} {2} {3}   pp {0,2} {1,3}

With tensor parallelism (tp > 1) each dp-cp group is one tp coordinate's, a stage's ranks are its tp-dp-cp group,
and each tp coordinate has pipelines of its own; with expert tensor parallelism (etp > 1, Megatron's default: tp)
the experts' etp, ep and edp groups lie within the stage too (pp outermost in both foldings):

  world 4, tp 2, pp 2, default order:  tp {0,1} {2,3}   dp-cp {0} {1} {2} {3}   pp {0,2} {1,3}   stage {0,1} {2,3}
                                       etp 2: etp {0,1} {2,3}   edp {0} {1} {2} {3}

At pp = 1 the groups are `rank_layout`'s (dp: the world). The embedding group of each pp group is its first and
last rank (default_embedding_ranks: where the word embedding and the output layer live), the position embedding
group its first rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from moezero.parallel.ranks import Partition, megatron_rank_layout

Ranks = Tuple[int, ...]


@dataclass(frozen=True)
class PipelineRankLayout:
    """Every group of each kind, as Megatron builds them (each a partition of the world)."""

    world_size: int
    expert_parallel_size: int
    pipeline_parallel_size: int
    use_tp_pp_dp_mapping: bool
    context_parallel_size: int
    tensor_parallel_size: int
    expert_tensor_parallel_size: int
    stage_groups: Partition  # every rank of one stage (Megatron's tp-dp-cp; dp_groups at tp 1)
    tp_groups: Partition  # ranks holding shards of one model replica (singletons at tp 1)
    dp_groups: Partition  # dense params' reduce group (Megatron's dp-cp), one per pp coordinate
    data_parallel_groups: Partition  # Megatron's dp: ranks reading distinct micro-batches (dp_groups at cp 1)
    cp_groups: Partition  # ranks sharing one micro-batch's sequence
    batch_groups: Partition  # ranks of one stage reading the same micro-batches (Megatron's tp-cp)
    pp_groups: Partition  # the stages of one pipeline, in stage order
    ep_groups: Partition
    edp_groups: Partition  # expert data parallel (Megatron's expert 'dp')
    etp_groups: Partition  # ranks holding ffn slices of the same experts (Megatron's expert 'tp')
    embedding_groups: Tuple[Ranks, ...]  # per pp group: its first and last rank (one rank at pp 1)
    position_embedding_groups: Tuple[Ranks, ...]  # per pp group: its first rank

    def group_of(self, partition: Partition, rank: int) -> Ranks:
        return next(group for group in partition if rank in group)

    def pp_rank_of(self, rank: int) -> int:
        return self.group_of(self.pp_groups, rank).index(rank)

    def dp_rank_of(self, rank: int) -> int:
        return self.group_of(self.dp_groups, rank).index(rank)

    def data_parallel_rank_of(self, rank: int) -> int:
        return self.group_of(self.data_parallel_groups, rank).index(rank)

    def cp_rank_of(self, rank: int) -> int:
        return self.group_of(self.cp_groups, rank).index(rank)

    def ep_rank_of(self, rank: int) -> int:
        return self.group_of(self.ep_groups, rank).index(rank)


def pipeline_rank_layout(
    world_size: int,
    expert_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    use_tp_pp_dp_mapping: bool = False,
    context_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
) -> PipelineRankLayout:
    """The stage, tp, dp(-cp), dp, cp, pp, ep, edp, etp partitions and the embedding groups (`megatron_rank_layout`'s);
    Megatron's refusals as one-line ConfigErrors."""
    layout = megatron_rank_layout(
        world_size,
        tensor_parallel_size=tensor_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_parallel_size=expert_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        use_tp_pp_dp_mapping=use_tp_pp_dp_mapping,
    )
    return PipelineRankLayout(
        world_size,
        expert_parallel_size,
        pipeline_parallel_size,
        use_tp_pp_dp_mapping,
        context_parallel_size,
        tensor_parallel_size,
        expert_tensor_parallel_size,
        stage_groups=layout.decoder["tp-dp-cp"],
        tp_groups=layout.decoder["tp"],
        dp_groups=layout.decoder["dp-cp"],
        data_parallel_groups=layout.decoder["dp"],
        cp_groups=layout.decoder["cp"],
        batch_groups=layout.decoder["tp-cp"],
        pp_groups=layout.decoder["pp"],
        ep_groups=layout.expert["ep"],
        edp_groups=layout.expert["dp"],
        etp_groups=layout.expert["tp"],
        embedding_groups=layout.embedding_groups,
        position_embedding_groups=layout.position_embedding_groups,
    )
