#!/usr/bin/env bash
# A small GPT-MoE on CPU: 2 processes, 8 experts with ep 2, ZeRO-2, the default stdlib corpus
# (or DATA_PATH=<prefix> for a Megatron .bin/.idx dataset). Extra flags are passed through.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
DATA_ARGS=()
if [ -n "${DATA_PATH:-}" ]; then DATA_ARGS=(--data-path "$DATA_PATH"); fi
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "${PYTHON:-python}" examples_moe/torchrun_local.py --standalone --nproc_per_node="$NPROC" \
    examples_moe/pretrain_gpt_moe.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 200 \
    --lr 2e-3 --min-lr 1e-4 --lr-warmup-iters 20 --lr-decay-style cosine --adam-beta2 0.95 \
    --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 \
    --num-experts 8 --moe-router-topk 2 --moe-layer-freq 2 --moe-aux-loss-coeff 1e-2 \
    --expert-model-parallel-size 2 --zero-stage 2 \
    --eval-interval 50 --eval-iters 4 --log-interval 10 --split 969,30,0 --no-bias-gelu-fusion \
    --distributed-backend gloo \
    --save checkpoints/gpt_moe_small --load checkpoints/gpt_moe_small --save-interval 100 --exit-signal-handler \
    --tensorboard-dir runs/run_gpt_moe_small \
    "${DATA_ARGS[@]}" "$@"
