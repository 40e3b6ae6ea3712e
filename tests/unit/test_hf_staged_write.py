"""An export killed mid-write (SIGKILL: no `finally` runs) leaves its staging folder beside the target; the next
export into the same target removes it, names it, and writes a model transformers loads."""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import moezero.hf as hub
from tests.hf_oracle import hf_logits, load_with_transformers, tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the child exports, and after its first shard is written signals and waits to be killed
KILLED_EXPORT = """
import sys, time
import moezero.hf as hub
import moezero.hf.save as save

source, target, marker = sys.argv[1:4]
write_shard = save.write_shard

def write_then_wait(*args):
    write_shard(*args)
    open(marker, "w").close()
    time.sleep(600)

save.write_shard = write_then_wait
hub.save_pretrained(hub.from_pretrained(source), target)
"""


def _export_killed_after_its_first_shard(source, target, marker):
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_EXPORT, source, target, marker],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            assert child.poll() is None, child.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the export never wrote its first shard"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


def test_the_next_export_removes_a_killed_exports_staging_folder(tmp_path):
    source, target, other = str(tmp_path / "source"), str(tmp_path / "out"), str(tmp_path / "out.v2")
    tiny_model("qwen3_moe", seed=4).float().save_pretrained(source)
    _export_killed_after_its_first_shard(source, target, str(tmp_path / "marker"))
    _export_killed_after_its_first_shard(source, other, str(tmp_path / "marker2"))
    left = glob.glob(os.path.join(str(tmp_path), ".moezero-export-out.????????"))  # mkdtemp: 8 characters
    assert len(left) == 1 and glob.glob(os.path.join(left[0], "*.safetensors")), left
    assert not os.path.exists(os.path.join(target, "model.safetensors.index.json"))

    model = hub.from_pretrained(source)
    with pytest.warns(UserWarning, match=f"removed {os.path.basename(left[0])}, the staging folder of an export"):
        hub.save_pretrained(model, target)
    assert not os.path.exists(left[0])
    # another target's staging folder (out.v2's, whose name starts like out's) is not this export's to remove
    assert len(glob.glob(os.path.join(str(tmp_path), ".moezero-export-out.v2.*"))) == 1
    probe = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        hf_logits(load_with_transformers(target), probe),
        hf_logits(load_with_transformers(source), probe),
        rtol=0,
        atol=1e-5,
    )


def test_an_exported_tokenizer_brings_its_folders_files_and_replaces_another_ones(tmp_path):
    """A run whose --tokenizer-model is a tokenizer.json file: the export copies it and the files beside it that
    declare its special tokens; written over a folder that holds another tokenizer, that one's other files go
    (another tokenizer_config.json beside the new tokenizer.json would name other special tokens)."""
    from moezero.hf.run_tokenizer import run_tokenizer_files

    source = tmp_path / "tok"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "unrelated.txt"):
        (source / name).write_text("{}")
    files = run_tokenizer_files(
        {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(source / "tokenizer.json")}
    )
    assert sorted(files) == ["tokenizer.json", "tokenizer_config.json"]
    model, out = hub.from_pretrained(_tiny_source(tmp_path)), str(tmp_path / "out")
    os.makedirs(out)
    for name in ("special_tokens_map.json", "chat_template.jinja", "README.md"):
        with open(os.path.join(out, name), "w") as f:
            f.write("another tokenizer's")
    with open(os.path.join(out, "model.safetensors"), "w") as f:
        f.write("old weights")
    hub.save_pretrained(model, out, overwrite=True, tokenizer_files=files)
    assert sorted(os.listdir(out)) == [
        "README.md",
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def _tiny_source(tmp_path):
    source = str(tmp_path / "source")
    tiny_model("qwen3_moe", seed=2).float().save_pretrained(source)
    os.remove(os.path.join(source, "generation_config.json"))
    return source
