"""tools/generate.py continues a prompt from a 2-rank ep-2 checkpoint of stage 2 and of stage 3, and from
its consolidated file, exactly as the live stage-3 model (both ranks) does with the same seed."""

import sys

import torch

from moezero.data import ByteLevelTokenizer
from moezero.models import generate
from moezero.recipe import pretraining
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs
from tests.integration.scripts import run, tool, tool_in_process

PROMPT = "def main("
SAMPLING = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=5)


def _train_two_stages_and_generate_live(cache, root):
    """Rank-local result: the live stage-3 model's continuation (every rank must get the same)."""
    tok = ByteLevelTokenizer()
    for stage in (2, 3):
        argv = TINY + [
            "--train-iters",
            "6",
            "--fp64",
            "--expert-model-parallel-size",
            "2",
            "--zero-stage",
            str(stage),
            "--save",
            f"{root}/stage{stage}",
            "--data-cache-path",
            cache,
        ]
        run_ = pretraining(configs(argv))
        run_.train()
        if stage == 3:  # the forward gathers the sharded params itself; both ranks run every forward
            s = SAMPLING
            live = generate(
                run_.model,
                tok.tokenize(PROMPT),
                s["max_new_tokens"],
                s["temperature"],
                s["top_k"],
                s["top_p"],
                torch.Generator().manual_seed(s["seed"]),
                vocab_size=tok.vocab_size,
                stop_token=tok.eod,
            )
        run_.groups.destroy()
    return PROMPT + tok.detokenize(live)


def _generate(load):
    flags = [x for k, v in SAMPLING.items() for x in ("--" + k.replace("_", "-"), str(v))]
    proc = tool_in_process("generate", ["--load", load, "--prompt", PROMPT] + flags)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.rstrip("\n")


def test_generate_continues_a_prompt_from_any_layout_and_stage(tmp_path):
    root = str(tmp_path / "ckpt")
    live = run_distributed(_train_two_stages_and_generate_live, 2, str(tmp_path), root, timeout=300)
    assert live[0] == live[1] and live[0].startswith(PROMPT) and len(live[0]) > len(PROMPT)
    consolidated = str(tmp_path / "model.pt")
    # the tool as a script (its success path: test_checkpoint_errors runs its refusals)
    proc = run([sys.executable, tool("consolidate_checkpoint"), "--load", f"{root}/stage3", "--output", consolidated])
    assert proc.returncode == 0, proc.stderr
    for load in (f"{root}/stage2", f"{root}/stage3", consolidated):
        assert _generate(load) == live[0], load


def test_the_tokenizer_is_rebuilt_from_every_field_the_run_stored():
    """A TikTokenizer's pattern and special-token count and a NullTokenizer's size come from the checkpoint
    (with only the type and files, a run with 100 special tokens was fed ids 900 off); a typed --tokenizer-type
    or file wins."""
    sys.path.insert(0, tool("generate").rsplit("/", 1)[0])
    import generate as generate_tool

    stored = {
        "data": {
            "tokenizer_type": "TikTokenizer",
            "tokenizer_model": "vocab.json",
            "vocab_size": None,
            "tiktoken_pattern": "v1",
            "tiktoken_num_special_tokens": 100,
            "data_path": ["ignored"],
        }
    }
    args = generate_tool.build_parser().parse_args(["--load", "x", "--prompt", "p"])
    rebuilt = generate_tool.tokenizer_config(stored, args)
    assert (rebuilt.tiktoken_pattern, rebuilt.tiktoken_num_special_tokens) == ("v1", 100)
    null = {"data": {"tokenizer_type": "NullTokenizer", "vocab_size": 300}}
    assert generate_tool.tokenizer_config(null, args).vocab_size == 300
    typed = generate_tool.build_parser().parse_args(
        ["--load", "x", "--prompt", "p", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "here"]
    )
    gpt2 = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "v.json", "merge_file": "m.txt"}
    rebuilt = generate_tool.tokenizer_config({"data": gpt2}, typed)  # the run's files are not the new type's
    assert rebuilt.tokenizer_type == "HuggingFaceTokenizer" and rebuilt.tokenizer_model.endswith("here")


def test_eval_quantized_tokenizes_as_the_run_did_unless_told(monkeypatch):
    """tools/eval_quantized.py --load: the checkpoint's tokenizer, the tokenizer flags typed laid over it (a GPT-2
    BPE run was scored on byte-level ids: 6.177 where its own tokenizer gives 6.246)."""
    sys.path.insert(0, tool("eval_quantized").rsplit("/", 1)[0])
    import eval_quantized
    from moezero.config import DataConfig

    stored = {
        "tokenizer_type": "TikTokenizer",
        "tokenizer_model": "v.json",
        "tiktoken_num_special_tokens": 100,
        "split": "1,1,1",
    }
    monkeypatch.setattr(eval_quantized, "_stored_configs", lambda path: {"data": stored})
    taken = eval_quantized.run_tokenizer(DataConfig(), "ckpt", set())
    assert (taken.tokenizer_type, taken.tiktoken_num_special_tokens, taken.split) == ("TikTokenizer", 100, "969,30,1")
    moved = eval_quantized.run_tokenizer(DataConfig(tokenizer_model="new.json"), "ckpt", {"data.tokenizer_model"})
    assert moved.tokenizer_model.endswith("new.json") and moved.tiktoken_num_special_tokens == 100
    other = eval_quantized.run_tokenizer(DataConfig(), "ckpt", {"data.tokenizer_type"})
    assert other == DataConfig()  # another tokenizer takes none of the run's
    assert eval_quantized.run_tokenizer(DataConfig(), None, set()) == DataConfig()


def test_the_tools_name_a_bad_output_or_quantized_file_in_one_line(tmp_path):
    """A folder as --output, or a missing / foreign --quantized file: one line, before any work (a traceback after
    the whole consolidation once)."""
    import pytest

    from moezero.compression.inference import read_exported
    from moezero.config import ConfigError
    from moezero.training.args import prepare_output_file

    with pytest.raises(ConfigError, match="--output=.*: is a folder; give a file path"):
        prepare_output_file(str(tmp_path))
    prepare_output_file(str(tmp_path / "new" / "deeper" / "model.pt"))
    assert (tmp_path / "new" / "deeper").is_dir()
    with pytest.raises(ConfigError, match="missing.mzq: no such file"):
        read_exported(str(tmp_path / "missing.mzq"))
    (tmp_path / "garbage.mzq").write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match="garbage.mzq: not a moezero quantized model"):
        read_exported(str(tmp_path / "garbage.mzq"))
