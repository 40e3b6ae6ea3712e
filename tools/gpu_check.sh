#!/usr/bin/env bash
# One command on a GPU machine: build moezero with its CUDA kernels, run every ops test (the
# gpu-marked CUDA-vs-reference tests included), pretraining on the GPU against the CPU
# (tests/integration/test_gpu_pretrain.py) and the CUDA benchmark.
#
#   tools/gpu_check.sh            # uses .venv/bin/python if present, else python
#
# The CUDA kernels (csrc/cuda/*.cu) wired into the public ops (moezero/ops/_library.py WIRED["cuda"])
# are the ones this script showed correct and faster than the best pure-torch version (on an H200);
# run it again after changing any of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # moezero is built in place, not installed
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
# a compiler that links libstdc++ statically into an extension (a wrapper adding -static-libstdc++) makes
# every TORCH_CHECK in it crash the process instead of raising: its own ostream meets the process's locale
for so in moezero/_C.*.so moezero/_C_cuda.*.so; do
    ldd "$so" | grep -q "libstdc++" || { echo "gpu_check: $so has libstdc++ linked in statically by" \
        "${CXX:-c++}; build with a g++ that links it dynamically (e.g. CXX=/usr/bin/g++)"; exit 1; }
done

# the GPU's tests first, then the CPU kernels' tests; a failing test still lets the rest and the benchmark
# run, and the script's status is the tests'
tests=0
MOEZERO_REQUIRE_EXT=1 "$PY" -m pytest -m gpu tests/ops tests/integration/test_gpu_pretrain.py -q -rs -s || tests=$?
MOEZERO_REQUIRE_EXT=1 "$PY" -m pytest -m "not gpu" tests/ops -q -rs || tests=$?
"$PY" tools/bench_ops.py --device cuda --reps 20 --wire-all \
    --layer-tokens 16384 --layer-hidden 1024 --layer-ffn 4096
exit $tests
