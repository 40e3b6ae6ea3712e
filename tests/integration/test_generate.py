"""tools/generate.py continues a prompt from a 2-rank ep-2 checkpoint of stage 2 and of stage 3, and from
its consolidated file, exactly as the live stage-3 model (both ranks) does with the same seed."""
import sys

import torch

from moezero.data import ByteLevelTokenizer
from moezero.models import generate
from moezero.recipe import pretraining
from tests.dist_utils import run_distributed
from tests.integration.pretrain_utils import TINY, configs
from tests.integration.scripts import run, tool

PROMPT = "def main("
SAMPLING = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=5)


def _train_two_stages_and_generate_live(cache, root):
    """Rank-local result: the live stage-3 model's continuation (every rank must get the same)."""
    tok = ByteLevelTokenizer()
    for stage in (2, 3):
        argv = TINY + ["--train-iters", "6", "--fp64", "--expert-model-parallel-size", "2", "--zero-stage", str(stage),
                       "--save", f"{root}/stage{stage}", "--data-cache-path", cache]
        run_ = pretraining(configs(argv))
        run_.train()
        if stage == 3:  # the forward gathers the sharded params itself; both ranks run every forward
            s = SAMPLING
            live = generate(run_.model, tok.tokenize(PROMPT), s["max_new_tokens"], s["temperature"], s["top_k"],
                            s["top_p"], torch.Generator().manual_seed(s["seed"]), vocab_size=tok.vocab_size,
                            stop_token=tok.eod)
        run_.groups.destroy()
    return PROMPT + tok.detokenize(live)


def _generate(load):
    flags = [x for k, v in SAMPLING.items() for x in ("--" + k.replace("_", "-"), str(v))]
    proc = run([sys.executable, tool("generate"), "--load", load, "--prompt", PROMPT] + flags, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.rstrip("\n")


def test_generate_continues_a_prompt_from_any_layout_and_stage(tmp_path):
    root = str(tmp_path / "ckpt")
    live = run_distributed(_train_two_stages_and_generate_live, 2, str(tmp_path), root, timeout=300)
    assert live[0] == live[1] and live[0].startswith(PROMPT) and len(live[0]) > len(PROMPT)
    consolidated = str(tmp_path / "model.pt")
    proc = run([sys.executable, tool("consolidate_checkpoint"), "--load", f"{root}/stage3", "--output", consolidated])
    assert proc.returncode == 0, proc.stderr
    for load in (f"{root}/stage2", f"{root}/stage3", consolidated):
        assert _generate(load) == live[0], load
