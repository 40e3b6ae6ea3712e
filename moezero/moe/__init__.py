from moezero.config import MoEConfig
from moezero.moe.layer import MoELayer, MoEStats, expert_parallel

__all__ = ["MoEConfig", "MoELayer", "MoEStats", "expert_parallel"]
