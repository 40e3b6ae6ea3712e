"""An expert stack split over expert tensor parallelism carries an ExpertShard (its experts among the global ones)
and a TensorShard (its ffn slice of them): the optimizer's global coordinates compose both. The oracle: a global
tensor whose values are their own flat indices, cut as the ranks hold it."""

import itertools

import torch
from torch import nn

from moezero.parallel.expert_marker import ExpertShard, mark_expert_parallel
from moezero.parallel.tensor_marker import TensorShard, mark_tensor_parallel
from moezero.zero.zero_param import global_placement, param_global_ranges

E, D, F = 4, 3, 4  # experts, hidden, ffn (a GLU fc1 is [gate | up]: 2F wide)
EP, ETP = 2, 2


def _rank_params():
    """Per (ep rank, etp rank): the tagged w1 (E/ep, D, 2F/etp) and w2 (E/ep, F/etp, D) slices of index tensors."""
    L = E // EP
    w1 = torch.arange(E * D * 2 * F, dtype=torch.float64).view(E, D, 2 * F)
    w2 = torch.arange(E * F * D, dtype=torch.float64).view(E, F, D)
    for ep_rank, etp_rank in itertools.product(range(EP), range(ETP)):
        experts = ExpertShard(L, ep_rank, EP)
        shards = (
            (w1, TensorShard.split((L, D, 2 * F), 2, etp_rank, ETP, (F, F))),
            (w2, TensorShard.split((L, F, D), 1, etp_rank, ETP)),
        )
        for whole, shard in shards:
            p = nn.Parameter(shard.local_of(whole[ep_rank * L : (ep_rank + 1) * L]))
            mark_expert_parallel(p, experts)
            mark_tensor_parallel(p, shard)
            yield whole, p


def test_etp_expert_slices_sit_at_their_global_coordinates():
    """Each rank's elements map to the global flat indices they hold (the experts of its ep rank: an offset the
    TensorShard alone does not know), and the four ranks' slices tile each global tensor once."""
    covered = {}
    for whole, p in _rank_params():
        shape, first = global_placement(p)
        assert shape == tuple(whole.shape)
        indices = [i for lo, hi in param_global_ranges(p) for i in range(lo, hi)]
        assert indices == p.detach().flatten().long().tolist()
        assert first == indices[0]
        covered.setdefault(id(whole), []).extend(indices)
    for indices in covered.values():
        assert sorted(indices) == list(range(len(indices)))
