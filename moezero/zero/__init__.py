from moezero.parallel.agreement import RanksDisagree
from moezero.zero.loss_scaler import DynamicLossScaler
from moezero.zero.model_guard import ParameterSetChanged
from moezero.zero.muon import Muon, check_muon_settings, muon_param_groups
from moezero.zero.optimizer import ZeroOptimizer
from moezero.zero.param_groups import weight_decay_groups
from moezero.zero.param_guard import ParamNotGathered
from moezero.zero.precision_aware_adam import STATE_DTYPES, PrecisionAwareAdam
from moezero.zero.reducer import GradientHookError
from moezero.zero.sharded_gradient import GradientIsSharded, ShardedGradient
from moezero.zero.state import consolidate
from moezero.zero.strided_ranges import Span, intersects, overlap, shard_spans

__all__ = [
    "ZeroOptimizer",
    "DynamicLossScaler",
    "GradientHookError",
    "ParameterSetChanged",
    "ParamNotGathered",
    "RanksDisagree",
    "weight_decay_groups",
    "consolidate",
    "PrecisionAwareAdam",
    "Muon",
    "muon_param_groups",
    "check_muon_settings",
    "STATE_DTYPES",
    "GradientIsSharded",
    "ShardedGradient",
    "Span",
    "intersects",
    "overlap",
    "shard_spans",
]
