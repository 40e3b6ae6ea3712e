#!/usr/bin/env bash
# One command on a GPU machine: build moezero with its CUDA kernels, run every ops test (the
# gpu-marked CUDA-vs-reference tests included) and the CUDA benchmark.
#
#   tools/gpu_check.sh            # uses .venv/bin/python if present, else python
#
# The CUDA kernels (csrc/cuda/*.cu) are EXPERIMENTAL until this script has passed on a GPU; none
# is wired into the public ops (moezero/ops/_library.py WIRED["cuda"]) before then, and only the
# ones that the bench shows faster than the best pure-torch version should be.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python

"$PY" - <<'PYEOF'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device")
print(f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
PYEOF
command -v nvcc >/dev/null || { echo "gpu_check: nvcc not on PATH (set CUDA_HOME and PATH)"; exit 1; }

# build in place; setup.py never fails on a compile error, so check the import right after
MOEZERO_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-8} "$PY" setup.py build_ext --inplace
"$PY" -c "import torch, moezero._C, moezero._C_cuda; print('gpu_check: moezero._C and moezero._C_cuda load')"

MOEZERO_REQUIRE_EXT=1 "$PY" -m pytest tests/ops -q -rs
"$PY" tools/bench_ops.py --device cuda --reps 20 --wire-all \
    --layer-tokens 16384 --layer-hidden 1024 --layer-ffn 4096
