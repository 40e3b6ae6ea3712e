from moezero.config import MoEConfig
from moezero.moe.layer import MoELayer, MoEStats, expert_parallel, reset_global_load_balancing

__all__ = ["MoEConfig", "MoELayer", "MoEStats", "expert_parallel", "reset_global_load_balancing"]
