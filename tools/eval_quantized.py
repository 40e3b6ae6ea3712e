#!/usr/bin/env python
"""Loss and perplexity of a quantized export and of the checkpoint it came from, on any number of ranks.

    python tools/eval_quantized.py --quantized model.mzq --load checkpoints/gpt_moe_qat
    torchrun --nproc_per_node=2 tools/eval_quantized.py --quantized model.mzq --expert-model-parallel-size 2

Reports the fp model (the checkpoint's fp32 masters), the fake-quantized model (those weights
quantized in the forward, as QAT does) and the exported model (packed integers, dequantized), on
the validation split of the default corpus or of --data-path, tokenized as the run did (with --load, its
tokenizer where no tokenizer flag is typed). Reads only the model description: no training batch settings.
"""

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist  # noqa: E402

from moezero.compression.inference import read_exported  # noqa: E402
from moezero.compression.report import evaluate_models, format_report  # noqa: E402
from moezero.compression.source import load_checkpoint_model  # noqa: E402
from moezero import checkpoint  # noqa: E402
from moezero.config import TOKENIZER_FIELDS, ConfigError, DataConfig, run_tokenizer_fields  # noqa: E402
from moezero.data import DataError  # noqa: E402
from moezero.parallel import ParallelGroups  # noqa: E402
from moezero.training.args import ArgumentParser, add_config_arguments, configs_from_args, given_dests  # noqa: E402
from moezero.training.job import init_distributed  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--quantized", default=None, help="the file tools/export_quantized.py wrote")
    parser.add_argument("--load", default=None, help="checkpoint (--save directory or iter_N folder)")
    parser.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="ranks sharing one copy of the experts"
    )
    parser.add_argument("--eval-samples", type=int, default=256, help="samples from the start of the split")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per forward")
    parser.add_argument("--seed", type=int, default=1234, help="dataset shuffle seed (the training default)")
    add_config_arguments(parser, DataConfig)
    return parser


def run_tokenizer(data: DataConfig, load, typed) -> DataConfig:
    """With --load: the run's tokenizer (its stored fields), the tokenizer flags typed laid over them."""
    if not load:
        return data
    given = {name: getattr(data, name) for name in TOKENIZER_FIELDS if f"data.{name}" in typed}
    fields = run_tokenizer_fields(_stored_configs(load).get("data") or {}, given)
    return dataclasses.replace(
        data, **{name: fields.get(name, getattr(DataConfig(), name)) for name in TOKENIZER_FIELDS}
    )


def _stored_configs(load) -> dict:
    """The run's configs without consolidating its weights (a consolidated file holds them anyway)."""
    if os.path.isfile(load):
        return load_checkpoint_model(load).configs
    return checkpoint.read_train_state(checkpoint.resolve_checkpoint(load)).get("configs") or {}


def _data_source(data: DataConfig) -> str:
    """What the evaluation reads, said on its report (the run's own data is not assumed: give its --data-path)."""
    if data.mock_data:
        return "Megatron's mock data"
    if data.data_path:
        return "--data-path " + " ".join(data.data_path)
    return "the default corpus (the Python standard library; give the run's --data-path for its data)"


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.quantized or args.load):
        parser.error("give --quantized, --load, or both")
    if args.eval_samples < 1 or args.micro_batch_size < 1:
        parser.error("--eval-samples and --micro-batch-size must be >= 1")
    try:
        data = run_tokenizer(configs_from_args(args, [DataConfig])["data"], args.load, given_dests(parser, argv))
        init_distributed("gloo", 2)
        groups = ParallelGroups.build(expert_parallel_size=args.expert_model_parallel_size)
        losses = evaluate_models(
            data,
            args.seed,
            args.eval_samples,
            args.micro_batch_size,
            quantized=args.quantized,
            checkpoint=args.load,
            groups=groups,
        )
        bits = read_exported(args.quantized)["quantization"]["weight_bits"] if args.quantized else None
        if groups.rank == 0:
            split = "validation" if data.split_weights[1] > 0 else "test"  # as eval_dataset reads
            print(
                f" evaluation on {args.eval_samples} samples of the {split} split of {_data_source(data)}, "
                f"world {groups.world_size}, ep {groups.ep_size}"
            )
            print(format_report(losses, bits), flush=True)
        return 0
    except (ConfigError, DataError, ValueError) as exc:
        parser.error(str(exc))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
