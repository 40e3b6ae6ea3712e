from moezero.parallel.expert_marker import ExpertShard, expert_shard_of, is_expert_parallel, mark_expert_parallel
from moezero.parallel.groups import ParallelGroups
from moezero.parallel.layout import RankLayout, rank_layout
from moezero.parallel.local_channel import ChannelError, ChannelTimeout
from moezero.parallel.transport import Transport
from moezero.parallel.work import Work

__all__ = [
    "ParallelGroups",
    "RankLayout",
    "rank_layout",
    "ExpertShard",
    "mark_expert_parallel",
    "expert_shard_of",
    "is_expert_parallel",
    "ChannelError",
    "ChannelTimeout",
    "Transport",
    "Work",
]
