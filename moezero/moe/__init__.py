from moezero.config import MoEConfig
from moezero.moe.layer import MoELayer, MoEStats

__all__ = ["MoEConfig", "MoELayer", "MoEStats"]
