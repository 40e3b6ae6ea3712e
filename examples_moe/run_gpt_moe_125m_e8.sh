#!/usr/bin/env bash
# GPT-MoE 125M-class (12 layers, hidden 768) with 8 experts on every other layer, sized for one
# node of 8 GPUs: ep 8, ZeRO-2, bf16. Needs a tokenized dataset: DATA_PATH=<prefix of .bin/.idx>
# (tools/preprocess_data.py) and a HuggingFace tokenizer directory in TOKENIZER.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATA_PATH:?set DATA_PATH to a Megatron dataset prefix}"
: "${TOKENIZER:?set TOKENIZER to a local HuggingFace tokenizer directory}"
NPROC=${NPROC:-8}
"${PYTHON:-python}" examples_moe/torchrun_local.py --standalone --nproc_per_node="$NPROC" \
    examples_moe/pretrain_gpt_moe.py \
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --ffn-hidden-size 2048 \
    --micro-batch-size 8 --global-batch-size 256 --train-iters 20000 \
    --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 2000 --lr-decay-style cosine --adam-beta2 0.95 \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 \
    --num-experts 8 --moe-router-topk 2 --moe-layer-freq 2 --moe-ffn-hidden-size 2048 \
    --moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 \
    --expert-model-parallel-size 8 --zero-stage 2 --bf16 \
    --data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
    --eval-interval 1000 --eval-iters 10 --log-interval 10 \
    --save checkpoints/gpt_moe_125m_e8 --load checkpoints/gpt_moe_125m_e8 --save-interval 1000 --exit-signal-handler \
    --tensorboard-dir runs/gpt_moe_125m_e8 "$@"
