"""The training layer: the pretraining script's configs, loop, checkpoints' resume and logging.

from moezero.training import HeapTrimmer   # the host heap policy a training loop of one's own may apply
"""

from moezero.training.host_memory import HeapTrimmer

__all__ = ["HeapTrimmer"]
