"""Every csrc/cuda/*.cu compiles with nvcc alone (no torch headers), for sm_80 and sm_90.

Catches a CUDA break on machines without a GPU. One nvcc process compiles all files for both
architectures, with the half/bf16 macros torch's CUDA build sets, so the kernels see what the
real extension build sees.
"""

import pathlib
import shutil
import subprocess

import pytest

CUDA_DIR = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "cuda"
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_sources_compile_with_nvcc(tmp_path):
    sources = sorted(str(p) for p in CUDA_DIR.glob("*.cu"))
    assert sources, f"no .cu files under {CUDA_DIR}"
    cmd = [
        "nvcc",
        "-c",
        *sources,
        "-odir",
        str(tmp_path),
        "-std=c++17",
        "-O2",
        "--threads",
        "2",
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90,code=sm_90",
        *TORCH_NVCC_DEFINES,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"nvcc failed:\n{result.stdout}\n{result.stderr}"
    assert sorted(p.stem for p in tmp_path.glob("*.o")) == sorted(pathlib.Path(s).stem for s in sources)
