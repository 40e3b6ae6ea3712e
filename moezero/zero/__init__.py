from moezero.zero.loss_scaler import DynamicLossScaler
from moezero.zero.optimizer import ParameterSetChanged, ZeroOptimizer
from moezero.zero.reducer import GradientHookError

__all__ = ["ZeroOptimizer", "DynamicLossScaler", "GradientHookError", "ParameterSetChanged"]
