"""What a run says about where it starts: --use-checkpoint-args (and --load-hf) name only the flags typed on the
command line whose values they replaced, never a default as the command line's; --load-hf into an empty
--load = --save says it starts from the Hub model, not from scratch."""

import dataclasses

from moezero.training.resume import ResumePoint, apply_checkpoint_args
from moezero.training.run_start import resolve_start
from tests.integration.pretrain_utils import configs

SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16"]


def _point(argv):
    saved = configs(argv)
    return ResumePoint("ckpt", 3, {s: dataclasses.asdict(getattr(saved, s)) for s in ("model", "moe")}, {})


def test_the_checkpoint_args_notice_names_typed_flags_only():
    point = _point(SHAPE)
    reported = []
    taken = apply_checkpoint_args(configs(["--num-layers", "4"]), point, reported.append)
    assert (taken.model.num_layers, taken.model.hidden_size) == (2, 32)  # both from the checkpoint
    assert reported == [" --use-checkpoint-args: --num-layers 2 (command line: 4)"]  # not --hidden-size's default


def test_load_hf_into_an_empty_load_says_it_starts_from_the_hub_model(tmp_path):
    from tests.hf_oracle import tiny_model

    hub, own = str(tmp_path / "hub"), str(tmp_path / "own")
    tiny_model("qwen3_moe", seed=3).float().save_pretrained(hub)
    start = resolve_start(
        configs(
            [
                "--mock-data",
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "96",
                "--seq-length",
                "16",
                "--load-hf",
                hub,
                "--load",
                own,
                "--save",
                own,
            ]
        )
    )
    assert start.point is None and start.hub_config is not None
    said = [line for line in start.notices if "no checkpoint in --load" in line]
    assert said == [
        f" no checkpoint in --load={own} yet (it is also --save): starting from the Hugging Face model --load-hf={hub}"
    ], start.notices
