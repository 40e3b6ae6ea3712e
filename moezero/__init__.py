"""moezero: Mixture-of-Experts GPT training with a ZeRO-1/2 optimizer that is correct for MoE."""

__version__ = "0.1.0"
