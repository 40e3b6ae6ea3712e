"""Hub folders checked before anything is built from them (--load-hf, tools/hf_checkpoint.py import,
moezero.hf.from_pretrained): files that do not hold the config's model (refused before a default-size model is
allocated), an index naming a missing shard, a tokenizer that cannot be read or is missing, a dtype no folder is
written in; and the tokenizer a run takes from a folder: the data's record decides, and --save-hf writes the run's
tokenizer and token ids."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from moezero.config import ConfigError
from moezero.data import DataError
from moezero.hf import CheckpointMismatch, run_configs
from moezero.hf.checkpoint_conversion import import_hub
from tests.bpe_files import write_bpe_files, write_sentencepiece_model
from tests.hf_oracle import tiny_model
from tests.integration.pretrain_utils import CORPUS, configs
from tests.integration.scripts import tool_in_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a run of a tiny Qwen3-MoE folder (512 ids: room for the byte-level corpus) on the committed byte-level corpus
RUN = [
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--train-iters",
    "1",
    "--lr",
    "1e-3",
    "--num-workers",
    "0",
    "--eval-iters",
    "1",
    "--eval-interval",
    "100",
    "--data-path",
    CORPUS,
    "--split",
    "98,2,0",
]

_ALLOCATE_UNDER_A_LIMIT = """
import resource, sys
import moezero.hf
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))   # the default Qwen3-MoE is 15B params
try:
    moezero.hf.from_pretrained(sys.argv[1])
except Exception as exc:
    print(type(exc).__name__, str(exc).splitlines()[0])
"""


def test_files_that_do_not_hold_the_configs_model_are_refused_before_allocating_it(tmp_path):
    """config.json with only model_type (transformers' defaults: a 15B Qwen3-MoE) beside one unrelated tensor:
    from_pretrained refuses it under a 3 GB address-space limit (it allocated the default model first), and so do
    --load-hf's and the import's reading of the folder, naming the tensors."""
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    save_file({"unrelated.weight": torch.zeros(2, 2)}, str(hub / "model.safetensors"))
    proc = subprocess.run(
        [sys.executable, "-c", _ALLOCATE_UNDER_A_LIMIT, str(hub)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.stdout.startswith(
        f"CheckpointMismatch {hub}: tensors missing for the config's model: "
        "['lm_head.weight', 'model.embed_tokens.weight'"
    ), proc.stdout + proc.stderr[-2000:]
    assert "tensors the model has no place for: ['unrelated.weight']" in proc.stdout
    for read in (run_configs, lambda path: import_hub(path, str(tmp_path / "ckpt"))):
        with pytest.raises(CheckpointMismatch, match="tensors missing for the config's model"):
            read(str(hub))
    assert not (tmp_path / "ckpt").exists()


@pytest.fixture
def hub(tmp_path):
    """A tiny Qwen3-MoE in two shards, with no tokenizer."""
    path = tmp_path / "hub"
    tiny_model("qwen3_moe", seed=3, vocab_size=512).float().save_pretrained(str(path), max_shard_size="100KB")
    return path


def test_an_index_naming_a_missing_shard_is_one_line_and_leaves_nothing(tmp_path, hub):
    from moezero.recipe import pretraining

    index = json.loads((hub / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.remove(hub / shard)
    save = tmp_path / "save"
    with pytest.raises(ConfigError) as refused:
        pretraining(configs(RUN + ["--load-hf", str(hub), "--save", str(save)]))
    assert str(refused.value) == (
        f"--load-hf={hub}: {hub}/model.safetensors.index.json: names {shard}, which the "
        "folder does not hold (a download or copy cut short?)"
    )
    assert not save.exists()  # the folder the save lock made is gone with the lock
    with pytest.raises(CheckpointMismatch, match=f"names {shard}, which the folder does not hold"):
        import_hub(str(hub), str(tmp_path / "ckpt"))


def test_a_tokenizer_that_cannot_be_read_or_is_missing_is_refused_naming_the_file(tmp_path, hub):
    """tokenizer.json not JSON, or a tokenizer_config.json whose tokenizer file is absent: --load-hf and the import
    refuse the folder naming the file (they trained with the byte-level tokenizer, or died naming nothing)."""
    from moezero.recipe import pretraining

    (hub / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(
        ConfigError,
        match=f"--load-hf={hub}: {hub}: holds tokenizer_config.json but no tokenizer "
        r"file \(tokenizer.json, tokenizer.model, tiktoken.model\)",
    ):
        pretraining(configs(RUN + ["--load-hf", str(hub)]))
    (hub / "tokenizer.json").write_text("{ not json")
    with pytest.raises(
        ConfigError, match=f"--load-hf={hub}: {hub}/tokenizer.json is not a Hugging Face tokenizer.json"
    ):
        pretraining(configs(RUN + ["--load-hf", str(hub)]))
    refused = tool_in_process("hf_checkpoint", ["import", str(hub), str(tmp_path / "ckpt")])
    lines = refused.stderr.strip().splitlines()
    assert (
        refused.returncode == 2
        and "tokenizer.json is not a Hugging Face tokenizer.json" in lines[-1]
        and "Traceback" not in refused.stderr
    ), refused.stderr


def test_every_tokenizer_form_of_a_folder_becomes_the_runs(tmp_path, hub):
    """A folder whose tokenizer is SentencePiece alone is the run's tokenizer (it trained with the byte-level
    one before); a folder without any keeps the command line's."""
    assert "data" not in run_configs(str(hub))
    os.replace(write_sentencepiece_model(str(tmp_path / "sp")), hub / "tokenizer.model")
    assert run_configs(str(hub))["data"] == {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(hub)}


def test_load_hf_does_not_switch_the_data_to_another_tokenizer(tmp_path, hub):
    """The folder's tokenizer.json is the run's, but the corpus was preprocessed byte-level (its record says so):
    refused naming both, before the model is built."""
    from moezero.recipe import pretraining

    write_bpe_files(str(hub))
    with pytest.raises(
        DataError,
        match=f"--data-path: {CORPUS} was tokenized with ByteLevelTokenizer .* the run's "
        f"tokenizer is HuggingFaceTokenizer {hub} ",
    ):
        pretraining(configs(RUN + ["--load-hf", str(hub), "--data-cache-path", str(tmp_path / "cache")]))


def test_save_hf_writes_the_runs_tokenizer_and_token_ids(tmp_path, hub):
    """A folder without a tokenizer, trained on byte-level data: the --save-hf folder holds a tokenizer that
    transformers encodes as the run did and names the run's end of document, not the source's eos 2 / bos 1."""
    import transformers

    from moezero.data import ByteLevelTokenizer
    from moezero.recipe import pretraining

    out = tmp_path / "hf"
    run = pretraining(
        configs(RUN + ["--load-hf", str(hub), "--save-hf", str(out), "--data-cache-path", str(tmp_path / "cache")])
    )
    run.train()
    run.groups.destroy()
    folder = out / "iter_0000001"
    config = json.loads((folder / "config.json").read_text())
    eod = ByteLevelTokenizer.eod
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, eod, None)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == eod
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "def f(x):\n    return x  # café, 数据"
    assert tokenizer.encode(text, add_special_tokens=False) == ByteLevelTokenizer().tokenize(text)
    assert tokenizer.eos_token_id == eod


def test_a_dtype_no_folder_is_written_in_is_refused_at_start(tmp_path, hub):
    """ "torch_dtype": "bf16" (transformers writes "bfloat16"): --save-hf refuses it when the run is built (it
    trained, then died in a traceback writing nothing), and so does the import."""
    from moezero.recipe import pretraining

    config = json.loads((hub / "config.json").read_text())
    config.pop("dtype", None)
    (hub / "config.json").write_text(json.dumps(dict(config, torch_dtype="bf16")))
    with pytest.raises(
        ConfigError,
        match=f"--save-hf={tmp_path / 'hf'}: the source's config.json torch_dtype 'bf16' "
        r"is not a dtype Hub weights are written in \(one of float32, bfloat16",
    ):
        pretraining(configs(RUN + ["--load-hf", str(hub), "--save-hf", str(tmp_path / "hf")]))
    with pytest.raises(CheckpointMismatch, match="torch_dtype 'bf16' is not a dtype"):
        import_hub(str(hub), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
