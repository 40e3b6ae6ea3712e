"""The data layer imports megatron-core's dataset modules without its package `__init__` (its models, optimizers
and compiled fusions: seconds of every run's start), and the rest of megatron-core still works in that process."""

import subprocess
import sys

import pytest

pytest.importorskip("megatron.core.datasets.helpers_cpp")

SCRIPT = r"""
import sys
from moezero.data._megatron import megatron_datasets

datasets = megatron_datasets()
print("deferred", "megatron.core.tensor_parallel" not in sys.modules, "megatron.core.optimizer" not in sys.modules,
      "torch._inductor" not in sys.modules)
import threading
import megatron.core
from megatron.core import parallel_state
print("submodule", "megatron.core.tensor_parallel" not in sys.modules)
found = {}
readers = [threading.Thread(target=lambda n=n: found.update({n: getattr(megatron.core, n, None) is not None}))
           for n in ("__version__", "Timers", "mpu", "ModelParallelConfig")]
for reader in readers:
    reader.start()
for reader in readers:
    reader.join()
print("threads", len(found) == 4 and all(found.values()))
print("version", megatron.core.__version__)
print("whole", "megatron.core.tensor_parallel" in sys.modules, megatron.core.mpu is parallel_state,
      megatron.core.datasets.gpt_dataset.GPTDataset is datasets.GPTDataset)
from megatron.core.transformer import TransformerConfig
print("config", TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4).ffn_hidden_size)
"""


def test_datasets_import_without_megatron_cores_init_and_the_package_stays_whole():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["deferred"] == "True True True"  # models, optimizers, torch.compile'd fusions not imported
    assert lines["submodule"] == "True"  # `from megatron.core import <submodule>` imports just it
    assert lines["threads"] == "True"  # threads reading it at once wait for one __init__
    import megatron.core.package_info as info

    assert lines["version"] == info.__version__  # the first other attribute ran megatron.core's __init__
    assert lines["whole"] == "True True True" and lines["config"] == "256"
