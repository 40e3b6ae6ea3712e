"""RSS stays flat over a long MoE run: the heap must not fill with holes (moezero/host_memory.py)."""
import os
import subprocess
import sys

LOOP = r"""
import torch
from moezero.moe import MoEConfig, MoELayer
from moezero.zero import ZeroOptimizer
from tests.heap import heap_free_bytes
torch.manual_seed(0)
layer = MoELayer(MoEConfig(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2), None)
opt = ZeroOptimizer(layer, torch.optim.AdamW, lr=1e-3)
free = []
for step in range(40):
    x = torch.randn(int(torch.randint(1024, 3072, ())), 256)   # token counts vary, as routing does
    y, stats = layer(x)
    (y.square().mean() + stats.aux_loss).backward()
    opt.step()
    opt.zero_grad()
    free.append(heap_free_bytes())
print(free[4], free[-1])
"""


def _free_heap(env_extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", LOOP], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300, check=True)
    early, late = map(int, out.stdout.split())
    return early, late


def test_free_heap_does_not_grow_over_a_run():
    early, late = _free_heap({})
    assert late - early < 16 * 2 ** 20, (early, late)
    # and the setting is what keeps it flat: glibc's default lets the free heap grow
    early, late = _free_heap({"MOEZERO_KEEP_MALLOC": "1"})
    assert late - early > 32 * 2 ** 20, (early, late)
