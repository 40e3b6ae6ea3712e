"""What the megatron_* oracle tools need before importing megatron-core 0.19's wheel on moezero's Python 3.11:
`typing.override` (a 3.12 name it imports) and a stand-in for its MoE paged-stash kernels (they import Triton,
which nothing the tools call uses). Import this module first; it changes nothing else."""

import sys
import types
import typing
import warnings

typing.override = getattr(typing, "override", lambda f: f)
_stub = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
_stub.GLOBAL_BLOCK_SIZE, _stub.paged_stash_copy_kernel, _stub.paged_stash_pop_kernel = 0, None, None
sys.modules[_stub.__name__] = _stub
warnings.filterwarnings("ignore")
