"""Build moezero. The C++ (CPU) extension is always attempted, CUDA only when torch has CUDA.

A failed compile never fails the install: the package then runs its pure-PyTorch
reference kernels (moezero/ops/reference.py). Install torch first and build with
`pip install --no-build-isolation -e .` so pip never fetches a second (CUDA) torch
into an isolated build environment.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

EXT_NAME = "moezero._C"
CUDA_EXT_NAME = "moezero._C_cuda"


def _extensions():
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("moezero: torch is not importable at build time; skipping the C++ extension", file=sys.stderr)
        return [], {}
    cpu_sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_binding = "csrc/cuda/bindings_cuda.cpp"
    cpu_sources = [s for s in cpu_sources if s != cuda_binding]
    if not cpu_sources:
        return [], {}
    linux = sys.platform.startswith("linux")
    openmp = ["-fopenmp"] if linux else []
    # libstdc++ named on the link line: a compiler that links it in statically (one GPU image's g++ wrapper did)
    # then links the process's shared one instead, and a TORCH_CHECK raises rather than crashing the process
    shared_libstdcxx = ["-lstdc++"] if linux else []
    # no -std flag: cpp_extension adds the standard the installed torch's headers need. -fno-trapping-math: no
    # kernel reads the floating-point exception flags, and it lets GCC vectorise the selects around a float -> int
    # conversion (gelu.cpp's exp) for AVX2, which has no masked conversions. -ffp-contract=off: only the std::fma
    # written in the source fuse, so a kernel's clones for CPUs with and without FMA compute the same bits
    exts = [
        cpp_extension.CppExtension(
            EXT_NAME,
            cpu_sources,
            extra_compile_args={"cxx": ["-O3", "-fno-trapping-math", "-ffp-contract=off"] + openmp},
            extra_link_args=openmp + shared_libstdcxx,
        )
    ]
    if torch.cuda.is_available() or os.environ.get("MOEZERO_BUILD_CUDA") == "1":
        if torch.version.cuda and cpp_extension.CUDA_HOME:
            cu_sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
            exts.append(
                cpp_extension.CUDAExtension(
                    CUDA_EXT_NAME,
                    cu_sources,
                    extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
                    extra_link_args=shared_libstdcxx,
                )
            )
    return exts, {"build_ext": _optional_build_ext(cpp_extension.BuildExtension)}


def _optional_build_ext(base):
    class OptionalBuildExt(base):
        """Build the extensions, but let a missing or broken compiler leave the package usable."""

        def run(self):
            try:  # torch's BuildExtension also probes the compiler before any extension is built
                super().run()
            except Exception as exc:
                print(
                    f"moezero: building the C++/CUDA extensions failed ({exc}); the pure-PyTorch "
                    "reference kernels will be used",
                    file=sys.stderr,
                )

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # one extension failing (e.g. CUDA) keeps the others
                print(
                    f"moezero: building {ext.name} failed ({exc}); the pure-PyTorch reference kernels will be used",
                    file=sys.stderr,
                )

    return OptionalBuildExt


ext_modules, cmdclass = _extensions()

setup(
    name="moezero",
    version="0.1.0",
    description="Mixture-of-Experts GPT training with a correct ZeRO-1/2 optimizer and expert parallelism",
    packages=find_packages(include=["moezero", "moezero.*"]),
    # Megatron's flags (tools/megatron_arguments.py), transformers' config defaults (tools/hf_config_defaults.py)
    package_data={"moezero.training": ["assets/megatron_arguments.json"], "moezero.hf": ["config_defaults.json"]},
    python_requires=">=3.10",
    # torch: this machine pins 2.13.0 (CPU build); GPU users may use any 2.6 <= torch < 3 with CUDA.
    install_requires=[
        "torch>=2.6,<3",
        "numpy",
        "einops",
        "tensorboard",
        "megatron-core>=0.16.1,<0.18",
        "psutil",
        "filelock",
        "tokenizers",  # GPT-2 BPE (--vocab-file/--merge-file) and local HuggingFace tokenizers
        "safetensors",  # moezero.hf: Hugging Face checkpoints in and out
        "xxhash",  # checkpoint checksums, hashed as the shards are written (4x zlib's crc32)
    ],
    # transformers: the test oracle for model logits (test_gpt_oracle.py, test_hf_families.py; 5.x:
    # experts_implementation), never a runtime dependency; sentencepiece: the SentencePiece tokenizer types only;
    # tiktoken: TikTokenizer only; wandb: --wandb-project only (the tests read an offline run); mkdocs-material,
    # mkdocstrings: the docs site (a test builds it with --strict); ruff: `make test` lints and checks the format
    # first (pinned: another release may format differently)
    extras_require={
        "dev": [
            "pytest",
            "ruff==0.17.6",
            "ninja",
            "transformers>=5",
            "sentencepiece",
            "tiktoken",
            "wandb",
            "mkdocs-material",
            "mkdocstrings[python]",
        ],
        "docs": ["mkdocs-material", "mkdocstrings[python]"],
        "sentencepiece": ["sentencepiece"],
        "tiktoken": ["tiktoken"],
        "wandb": ["wandb"],
        "bench": ["matplotlib"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
