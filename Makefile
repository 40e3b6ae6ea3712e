# The two commands of the README: `make train` and `make test`. Both create .venv when missing.
# torch is installed first, pinned (the CPU build on this machine), then the project without build
# isolation, so pip never pulls a second, multi-GB CUDA torch into a build environment.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moezero-installed

.PHONY: install train test test-fast bench hooks

install: $(STAMP)

# The repository's git hooks (.githooks/: a commit subject of at most 72 characters) for this clone.
hooks:
	git config core.hooksPath .githooks

$(STAMP): setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q setuptools wheel "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $@

# A short MoE GPT pretraining run on 2 local CPU processes (ep 2, ZeRO-2) on the default corpus
# (the Python standard library's sources, tokenized on first use); TensorBoard events in runs/gpt_moe_small,
# its checkpoint in checkpoints/make_train, which a second `make train` resumes (remove it for a new run).
# The flags are spelled out: the script's defaults are Megatron's (no experts, dropout 0.1, ...); the demo has
# no test split and the exact GELU (Megatron refuses the bias-GELU fusion's tanh one in MoE layers), so it
# prints no warning of its own.
# torchrun_local.py: torchrun with its stores listening on 127.0.0.1 only (torchrun's own listen everywhere).
SMALL_GPT_MOE = --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \
	--micro-batch-size 4 --global-batch-size 16 --train-iters 200 \
	--lr 2e-3 --min-lr 1e-4 --lr-warmup-iters 20 --lr-decay-style cosine --adam-beta2 0.95 \
	--hidden-dropout 0 --attention-dropout 0 \
	--num-experts 8 --moe-router-topk 2 --moe-layer-freq 2 --moe-aux-loss-coeff 1e-2 \
	--eval-interval 50 --eval-iters 4 --log-interval 10
train: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) examples_moe/torchrun_local.py --standalone --nproc_per_node=$(NPROC) \
		examples_moe/pretrain_gpt_moe.py $(SMALL_GPT_MOE) --expert-model-parallel-size 2 --zero-stage 2 \
		--split 969,30,0 --no-bias-gelu-fusion --distributed-backend gloo --tensorboard-dir runs/gpt_moe_small \
		--save checkpoints/make_train --load checkpoints/make_train --save-interval 100

# The whole suite (with the C++ kernels when they built), then the ZeRO exactness matrix on 2 ranks and the
# MoE tests again on the pure-PyTorch reference kernels (each op against its reference is in tests/ops, on both).
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -q --durations=15
	MOEZERO_DISABLE_EXT=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q \
		tests/distributed/test_moe_expert_parallel.py tests/unit/test_moe_layer.py \
		tests/distributed/test_zero_exactness.py::test_exactness_matrix_two_ranks

# The edit loop's tier (under 3 minutes on 2 cores): the lint, the unit and kernel tests, and one process group
# per distributed area (ZeRO's exactness matrix, expert parallelism, the pipeline). `make test` is still everything.
FAST_DISTRIBUTED = tests/distributed/test_zero_exactness.py::test_exactness_matrix_two_ranks \
	tests/distributed/test_moe_expert_parallel.py tests/distributed/test_pipeline_exactness.py
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests/unit tests/ops $(FAST_DISTRIBUTED) \
		--ignore=tests/unit/test_host_memory.py --durations=5

# The fair benchmarks on 2 CPU processes (creates DeepSpeed's venv under ~/.cache on first use; about
# 2 hours on 2 cores): end to end vs DeepSpeed, the optimizer alone, one MoE layer, expert scaling,
# memory over 200 steps, MFU against the CPU's own GEMM peak. Every table is medians over alternating
# rounds with [min-max].
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) tools/bench_vs_peers.py --large
	OMP_NUM_THREADS=1 $(PY) tools/bench_zero.py
	OMP_NUM_THREADS=1 $(PY) tools/bench_moe_layer.py
	OMP_NUM_THREADS=1 $(PY) tools/bench_scaling.py
	OMP_NUM_THREADS=1 $(PY) tools/bench_growth.py
	OMP_NUM_THREADS=1 $(PY) tools/bench_memory.py
	OMP_NUM_THREADS=1 $(PY) tools/bench_mfu.py --hidden 256,1024
	OMP_NUM_THREADS=1 $(PY) tools/bench_precision_aware.py
	OMP_NUM_THREADS=1 $(PY) tools/bench_checkpoint_checksums.py
