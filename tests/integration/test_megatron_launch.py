"""A Megatron-style launch line runs unchanged: its flags from an @file, GPT-2 BPE data that
tools/preprocess_data.py wrote, a sample-based schedule, the distributed optimizer, 2 ranks with ep 2."""

import re
import sys

import pytest

from moezero import checkpoint
from tests.bpe_files import CORPUS_JSONL, write_bpe_files, write_sentencepiece_model
from tests.integration.scripts import PRETRAIN, run, script_in_process, tool_in_process, torchrun

MEGATRON_FLAGS = """
# the parallelism Megatron scripts spell out
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 2 --use-distributed-optimizer
# model
--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32
--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-router-load-balancing-type aux_loss
# schedule in samples
--micro-batch-size 2 --global-batch-size 8 --train-samples 48 --lr 3e-3 --min-lr 3e-4
--lr-decay-style cosine --lr-warmup-fraction 0.1 --weight-decay 0.1 --clip-grad 1.0
# data
--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} --merge-file {merges} --data-path {data} --split 90,5,5
# logging, evaluation, checkpoints
--log-interval 1 --eval-interval 3 --eval-iters 1 --tensorboard-dir {tb}
--save {ckpt} --load {ckpt} --save-interval 3 --exit-signal-handler --exit-duration-in-mins 30
"""


def run_lrs(out):
    """The learning rate of each console line."""
    return [float(lr) for lr in re.findall(r"\] iteration .*?learning rate: (\S+)", out)]


def test_a_megatron_launch_line_runs_unchanged(tmp_path):
    files = write_bpe_files(str(tmp_path / "bpe"))
    prefix = str(tmp_path / "corpus")
    prep = tool_in_process(
        "preprocess_data",
        [
            "--input",
            CORPUS_JSONL,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            files["vocab"],
            "--merge-file",
            files["merges"],
            "--append-eod",
        ],
    )
    assert prep.returncode == 0, prep.stderr
    args = tmp_path / "megatron_args.txt"
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    args.write_text(
        MEGATRON_FLAGS.format(
            vocab=files["vocab"], merges=files["merges"], data=prefix + "_text_document", tb=tb, ckpt=ckpt
        )
    )
    proc = run(torchrun(2, PRETRAIN) + [f"@{args}", "--data-cache-path", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"no checkpoint in --load={ckpt} yet (it is also --save)" in out
    assert "world 2, ep 2, ZeRO stage 1" in out  # --use-distributed-optimizer
    assert re.search(r"iteration +6/ +6 \| consumed samples: +48 ", out)  # 48 samples / 8 per iteration
    # warmup 4.8 samples < one iteration: the first step runs at --lr-warmup-init (Megatron's scheduler at
    # num_steps 0), the second past the warmup, 8 samples into the cosine decay. Each line logs the lr the
    # scheduler holds after its step (Megatron's): the next step's
    assert run_lrs(out)[:2] == [pytest.approx(2.963611e-03, rel=1e-6), pytest.approx(2.576426e-03, rel=1e-6)]
    for label in ("max rss (MB)", "zero held (MB)", "moe max/mean load"):
        assert label in out
    assert "validation loss at iteration 6 on test set" in out  # the final test-split evaluation
    assert checkpoint.saved_iterations(ckpt) == [3, 6]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb, size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "moe/max-mean-load-ratio", "test/lm loss", "memory/zero-held-mb"} <= tags
    text = events.Tensors("arguments/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| --train-samples | 48 |" in text and "| --tokenizer-type | GPT2BPETokenizer |" in text
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(events.PluginTagToContent("hparams"))

    again = run(torchrun(2, PRETRAIN) + [f"@{args}", "--data-cache-path", str(tmp_path)], timeout=240)
    assert again.returncode == 0 and "is at iteration 6 = --train-iters: nothing to train" in again.stdout
    assert "validation loss at iteration 6 on test set" in again.stdout  # Megatron's relaunch evaluates again


# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh, sizes scaled down (and pp 4 -> 1, ep 8 -> 2),
# with the flags of examples/gpt3/train_gpt3_175b_distributed.sh it lacks (the step batch-size schedule in
# tokens, --attention-backend, Adam's betas)
MIXTRAL_AND_GPT3 = """
--use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 256 --num-layers 2
--hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --group-query-attention --num-query-groups 2
--init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000
--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model {tokenizer} --data-path {data} --split 90,8,2
--micro-batch-size 1 --global-batch-size 8 --step-batch-size-schedule "0:4 256:8" --lr 1e-4 --train-iters 6
--lr-decay-iters 5 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 2 --clip-grad 1.0
--bf16 --attention-backend auto --adam-beta1 0.9 --adam-beta2 0.95
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size 2
--use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 3 --eval-interval 3 --eval-iters 1 --save {ckpt} --load {ckpt}
--tensorboard-dir {tb} --no-load-optim --no-load-rng
"""


def test_the_mixtral_and_gpt3_scripts_train_on_two_ranks(tmp_path, capsys):
    pytest.importorskip("sentencepiece")  # Llama2Tokenizer's (the dev extra has it)
    tokenizer = write_sentencepiece_model(str(tmp_path / "spm"))
    prefix = str(tmp_path / "corpus")
    prep = tool_in_process(
        "preprocess_data",
        [
            "--input",
            CORPUS_JSONL,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "Llama2Tokenizer",
            "--tokenizer-model",
            tokenizer,
            "--append-eod",
        ],
    )
    assert prep.returncode == 0, prep.stderr
    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    args = tmp_path / "args.txt"
    args.write_text(MIXTRAL_AND_GPT3.format(tokenizer=tokenizer, data=prefix + "_text_document", ckpt=ckpt, tb=tb))
    launch = torchrun(2, PRETRAIN) + [f"@{args}", "--data-cache-path", str(tmp_path)]
    proc = run(launch, timeout=240)  # Megatron's --num-workers 2: each rank reads ahead in 2 processes
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "world 2, ep 2, ZeRO stage 1" in out
    # 256 tokens = 4 samples of 64 at batch 4, then batch 8: consumed 4, 12, 20, ...
    assert re.search(r"iteration +1/ +6 \| consumed samples: +4 .*global batch size: +4 ", out)
    assert re.search(r"iteration +6/ +6 \| consumed samples: +44 .*global batch size: +8 ", out)
    assert checkpoint.saved_iterations(ckpt) == [1, 3, 6]  # 1: Megatron's save when the micro-batches change
    again = run(launch + ["--train-iters", "7"], timeout=240)  # resumes weights only (--no-load-optim/rng)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        "resumed from" in again.stdout and "44 samples consumed (fresh optimizer state and RNG states)" in again.stdout
    )
    assert re.search(r"iteration +7/ +7 \| consumed samples: +52 ", again.stdout)
    fp8 = script_in_process([f"@{args}", "--fp8-format", "hybrid", "--fp8-amax-history-len", "16"], capsys)
    lines = fp8.stderr.strip().splitlines()  # one line per flag moezero lacks, all in one launch
    assert fp8.returncode == 2 and len(lines) == 3, fp8.stderr
    assert lines[0].endswith("error: 2 flags of this launch line are not supported:")
    assert "--fp8-format: not supported by moezero" in lines[1]
    assert "--fp8-amax-history-len: not supported by moezero" in lines[2]


def test_a_typo_costs_a_line(tmp_path):
    proc = run([sys.executable, PRETRAIN, "--num-layers", "2", "--moe-router-top-k", "2"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "unrecognized arguments: --moe-router-top-k 2; did you mean --moe-router-topk? (see --help)" in lines[0]
