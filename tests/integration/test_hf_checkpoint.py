"""tools/hf_checkpoint.py: a Hugging Face directory imported as a moezero checkpoint exports back bitwise; the
import continues with `--load --use-checkpoint-args --finetune` on 2 ranks (ep 2, ZeRO stage 3) with no model
flag typed (DeepSeek-V3's MTP layer included), and that run's checkpoint exports to a directory transformers loads to
moezero's logits. An
imported dense model (Qwen3) is upcycled with --moe-use-upcycling."""

import json
import os
import re
import sys

import pytest
import torch

from moezero.compression.inference import load_checkpoint_weights
from moezero.compression.source import load_checkpoint_model
from moezero.config import ConfigError
from tests.bpe_files import CORPUS_JSONL, write_bpe_files
from tests.dist_utils import run_distributed
from tests.hf_oracle import add_mtp_layer, hf_logits, hub_tensors, load_with_transformers, tiny_model
from tests.integration.pretrain_utils import configs, run_in_process
from tests.integration.scripts import run, tool, tool_in_process

RUN = [
    "--use-checkpoint-args",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "96",
    "--train-iters",
    "3",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--num-workers",
    "0",
    "--eval-iters",
    "1",
    "--eval-interval",
    "100",
    "--log-interval",
    "1",
]
FINETUNE = RUN + ["--finetune", "--expert-model-parallel-size", "2", "--zero-stage", "3"]
PROBE = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(0))


def _tool(*args):
    proc = tool_in_process("hf_checkpoint", list(args))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _on_two_ranks(argv):
    """The pretraining script's run on the 2 ranks of a pooled gloo world: rank 0's console output. (The torchrun
    launch itself is pinned by test_megatron_launch and test_preemption; this saves a launch's start per run.)"""
    return run_distributed(_console_of_a_run, 2, argv, timeout=240)[0]


def _console_of_a_run(argv):
    return run_in_process(argv)[1]


def _refusal_on_two_ranks(argv):
    """The ConfigError the run's start raises on the 2 ranks of a pooled gloo world (the same on both)."""
    messages = run_distributed(_refusal_of_a_run, 2, argv, timeout=240)
    assert messages[0] == messages[1], messages
    return messages[0]


def _refusal_of_a_run(argv):
    from moezero.recipe import pretraining

    try:
        pretraining(configs(argv))
    except ConfigError as exc:
        return str(exc)
    raise AssertionError(f"the run started: {argv}")


def _finetune_on_two_ranks_and_export(tmp_path, hub, ckpt):
    """FINETUNE on 2 ranks (ep 2, ZeRO stage 3) from the imported `ckpt`, then its checkpoint exported: the folder
    transformers loads gives moezero's logits of the checkpoint, not the source's. (the run, the folder)"""
    tuned, out = str(tmp_path / "tuned"), str(tmp_path / "out")
    stdout = _on_two_ranks(["--load", ckpt, "--save", tuned] + FINETUNE)
    assert "world 2, ep 2, ZeRO stage 3" in stdout
    _tool("export", tuned, out)
    model = load_checkpoint_weights(load_checkpoint_model(tuned)).double()
    with torch.no_grad():
        ours = model(PROBE)[0]
    theirs = hf_logits(load_with_transformers(out), PROBE)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-8)
    assert (theirs - hf_logits(load_with_transformers(hub), PROBE)).abs().max() > 1e-3, "the run trained it"
    return stdout, out


def test_import_finetune_on_two_ranks_and_export(tmp_path):
    hub, ckpt, back = str(tmp_path / "hub"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    tiny_model("deepseek_v3", seed=4).float().save_pretrained(hub)  # fp32 weights: the masters hold them exactly
    add_mtp_layer(hub)  # DeepSeek's multi-token-prediction layer: trained as Megatron's MTP depth, written back
    _tool("import", hub, ckpt)
    _tool("export", ckpt, back)
    original, exported = hub_tensors(hub), hub_tensors(back)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)

    tuned, out = _finetune_on_two_ranks_and_export(tmp_path, hub, ckpt)
    # the checkpoint's model (3 layers), not said as a command-line value: --num-layers was not typed (issue 71)
    assert "--num-layers 3 (command line" not in tuned and "| mtp_1 loss: " in tuned

    # the same run straight from the Hub folder, saving Hub folders itself (each rank writes its share),
    # stopped after 2 iterations and requeued: the run's own checkpoint wins over the Hub folder
    direct, own = str(tmp_path / "direct"), str(tmp_path / "own")
    command = [a for a in FINETUNE if a not in ("--use-checkpoint-args", "--finetune")] + [
        "--load-hf",
        hub,
        "--save-hf",
        direct,
        "--save-hf-interval",
        "2",
        "--save",
        own,
        "--load",
        own,
    ]
    first = _on_two_ranks(command + ["--exit-interval", "2"])
    assert "--num-layers 3 (command line" not in first  # the Hub folder's; --num-layers was not typed
    requeued = _on_two_ranks(command)
    assert "resuming from the run's own checkpoint" in requeued
    assert len(_losses(tuned)) == 3 and _losses(first) + _losses(requeued) == _losses(tuned)
    saved, final = hub_tensors(str(tmp_path / "direct" / "iter_0000003")), hub_tensors(out)
    assert sorted(saved) == sorted(final) and all(torch.equal(saved[k], final[k]) for k in final)
    index = json.loads((tmp_path / "direct" / "iter_0000002" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2, "one file per rank"


def _consolidated_loads_strictly(ckpt, out):
    """The import's consolidated file loads into a GPTModel with strict=True (it once held the non-persistent
    expert_bias and softmax_offset buffers a training save leaves out)."""
    from moezero.config import GPTConfig, MoEConfig, upgrade_stored_configs
    from moezero.models import GPTModel

    proc = tool_in_process("consolidate_checkpoint", ["--load", ckpt, "--output", out])
    assert proc.returncode == 0, proc.stderr
    blob = torch.load(out, weights_only=True)
    stored = upgrade_stored_configs(blob["configs"])
    gpt = GPTConfig(**dict(stored["model"], vocab_size=blob["model"]["embedding.weight"].shape[0]))
    GPTModel(gpt, MoEConfig(**stored["moe"])).load_state_dict(blob["model"], strict=True)


def test_gpt_oss_imports_trains_on_two_ranks_and_exports(tmp_path):
    """GPT-OSS (stacked experts, sinks, windows, YaRN): import -> export is bitwise; the import fine-tunes on 2
    ranks (ep 2, ZeRO stage 3) and its checkpoint exports to a folder transformers loads to moezero's logits.
    --save-hf at ep 2 is refused at start: no rank holds a layer's stacked experts whole."""
    hub, ckpt, back = str(tmp_path / "hub"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    tiny_model("gpt_oss", seed=4).float().save_pretrained(hub)
    _tool("import", hub, ckpt)
    _tool("export", ckpt, back)
    original, exported = hub_tensors(hub), hub_tensors(back)
    assert sorted(exported) == sorted(original) and all(torch.equal(exported[k], original[k]) for k in original)
    _consolidated_loads_strictly(ckpt, str(tmp_path / "consolidated.pt"))
    _finetune_on_two_ranks_and_export(tmp_path, hub, ckpt)
    refused = _refusal_on_two_ranks(["--load", ckpt, "--save-hf", str(tmp_path / "hf")] + FINETUNE)
    assert "holds all experts of a layer in one tensor" in refused


def test_a_directory_moezero_cannot_read_is_one_line(tmp_path):
    proc = run([sys.executable, tool("hf_checkpoint"), "import", str(tmp_path), str(tmp_path / "ckpt")])
    assert proc.returncode == 2 and "no config.json (not a Hugging Face model directory)" in proc.stderr
    assert "Traceback" not in proc.stderr


def _losses(stdout):
    return re.findall(r"iteration +\d+/ +\d+ .*?lm loss: (\S+)", stdout)


def _first_loss(stdout):
    return float(re.search(r"iteration +1/ +\d+ .*?lm loss: (\S+)", stdout).group(1))


def test_upcycling_an_imported_qwen3_dense_model(tmp_path):
    """--moe-use-upcycling from a Hugging Face dense model: the MoE run (ep 2, stage 3, experts copies of the
    dense MLPs) starts with the dense model's loss on the same first batch, then trains."""
    hub, dense = str(tmp_path / "hub"), str(tmp_path / "dense")
    tiny_model("qwen3", seed=5).float().save_pretrained(hub)
    _tool("import", hub, dense)
    common = ["--load", dense] + RUN + ["--hidden-dropout", "0", "--attention-dropout", "0"]
    base = _on_two_ranks(common + ["--finetune"])
    upcycled = _on_two_ranks(
        common
        + [
            "--moe-use-upcycling",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--expert-model-parallel-size",
            "2",
            "--zero-stage",
            "3",
        ]
    )
    assert "--moe-use-upcycling: the experts start as the dense MLPs of" in upcycled
    assert "world 2, ep 2, ZeRO stage 3" in upcycled
    # fp32: the MoE sums two equal expert outputs weighted 1/2 + 1/2 where the dense MLP has one (ulps apart)
    assert _first_loss(upcycled) == pytest.approx(_first_loss(base), rel=1e-5)
    assert re.search(r"iteration +3/ +3 .*moe max/mean load", upcycled)


def test_the_tokenizer_of_a_hub_directory_comes_with_the_import(tmp_path):
    """A tokenizer.json next to the weights: the imported checkpoint names it, so a run with
    --use-checkpoint-args tokenizes with it (here the data preprocessed by it, as its record says) without
    tokenizer flags; the
    run's export into a new folder carries it (without it AutoTokenizer gives an empty tokenizer)."""
    import transformers

    hub, ckpt, tuned, out = (str(tmp_path / n) for n in ("hub", "ckpt", "tuned", "out"))
    tiny_model("qwen3_moe", seed=6, vocab_size=512).float().save_pretrained(hub)
    write_bpe_files(hub, vocab_size=400)
    prefix = str(tmp_path / "corpus")
    prep = tool_in_process(
        "preprocess_data",
        [
            "--input",
            CORPUS_JSONL,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            hub,
            "--append-eod",
        ],
    )
    assert prep.returncode == 0, prep.stderr
    _tool("import", hub, ckpt)
    _, stdout = run_in_process(
        [
            "--load",
            ckpt,
            "--use-checkpoint-args",
            "--finetune",
            "--data-path",
            prefix + "_text_document",
            "--split",
            "90,5,5",
            "--train-iters",
            "2",
            "--seq-length",
            "16",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "2",
            "--num-workers",
            "0",
            "--eval-iters",
            "1",
            "--log-interval",
            "1",
            "--save",
            tuned,
            "--data-cache-path",
            str(tmp_path),
        ]
    )
    # the data's tokenizer record names the folder's tokenizer: a run with another would have been refused
    assert "tokenizer record" not in stdout
    assert re.search(r"iteration +2/ +2 .*lm loss", stdout)
    _tool("export", tuned, out)
    theirs, ours = (transformers.AutoTokenizer.from_pretrained(d) for d in (hub, out))
    text = "def tokenize(self, text):"
    assert ours.encode(text) == theirs.encode(text) and len(ours.encode(text)) > 3


def test_an_export_leaves_exactly_its_own_weights_and_an_import_keeps_a_run(tmp_path):
    """An export into a folder holding other weights (an old single-file model, a surplus shard) is refused in one
    line and changes nothing; with --overwrite the folder holds exactly the export's weights (its tokenizer and the
    files transformers never loads weights from, such as a model.pt being exported, stay)
    and transformers loads the exported model. An import into a folder holding a run's checkpoints is refused and
    `latest` stays."""
    import os
    import shutil

    from moezero import checkpoint

    hub, ckpt, used = str(tmp_path / "hub"), str(tmp_path / "ckpt"), str(tmp_path / "used")
    tiny_model("qwen3_moe", seed=7).float().save_pretrained(hub)
    _tool("import", hub, ckpt)
    tiny_model("qwen3_moe", seed=8).float().save_pretrained(used, max_shard_size="1GB")  # model.safetensors
    shutil.copyfile(os.path.join(used, "model.safetensors"), os.path.join(used, "model-00009-of-00009.safetensors"))
    for kept in ("tokenizer.json", "model.pt", "training_args.bin"):  # files transformers never loads weights from
        with open(os.path.join(used, kept), "w") as f:
            f.write("{}")
    with open(os.path.join(used, "adapter_config.json"), "w") as f:  # a PEFT adapter's: its base model would load
        f.write("{}")
    before = sorted(os.listdir(used))
    refused = tool_in_process("hf_checkpoint", ["export", ckpt, used])
    lines = refused.stderr.strip().splitlines()
    assert (
        refused.returncode == 2
        and "holds weights already (model-00009-of-00009.safetensors, model.safetensors" in lines[-1]
        and "Traceback" not in refused.stderr
        and sorted(os.listdir(used)) == before
    )
    _tool("export", ckpt, used, "--overwrite")
    assert sorted(os.listdir(used)) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.pt",
        "model.safetensors.index.json",
        "tokenizer.json",
        "training_args.bin",
    ]
    with (
        open(os.path.join(used, "generation_config.json")) as f,
        open(os.path.join(hub, "generation_config.json")) as g,
    ):
        assert json.load(f) == json.load(g)  # the import's, carried through the checkpoint
    theirs = hf_logits(load_with_transformers(used), PROBE)
    torch.testing.assert_close(theirs, hf_logits(load_with_transformers(hub), PROBE), rtol=0, atol=1e-10)

    run_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(ckpt, "iter_0000000"), os.path.join(run_dir, "iter_0000002"))
    with open(os.path.join(run_dir, checkpoint.POINTER), "w") as f:
        f.write("2")
    refused = tool_in_process("hf_checkpoint", ["import", hub, run_dir])
    assert refused.returncode == 2 and "holds a run's checkpoints (iterations 2)" in refused.stderr
    assert checkpoint.latest_iteration(run_dir) == 2 and checkpoint.saved_iterations(run_dir) == [2]


def test_a_bf16_source_exports_in_bf16_unless_told(tmp_path):
    """Import keeps fp32 masters; export writes the source's dtype (bf16: the same bytes as the source, half the
    fp32 size), or the one --dtype names."""
    import transformers

    fp32, hub, ckpt = str(tmp_path / "fp32"), str(tmp_path / "hub"), str(tmp_path / "ckpt")
    tiny_model("qwen3_moe", seed=9).float().save_pretrained(fp32)
    transformers.AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(hub)
    _tool("import", hub, ckpt)
    _tool("export", ckpt, str(tmp_path / "back"))
    source, back = hub_tensors(hub), hub_tensors(str(tmp_path / "back"))
    assert sorted(back) == sorted(source)
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], source[k]) for k in source)
    _tool("export", ckpt, str(tmp_path / "wide"), "--dtype", "float32")
    assert all(t.dtype == torch.float32 for t in hub_tensors(str(tmp_path / "wide")).values())


def test_use_checkpoint_args_takes_an_imported_models_training_values(tmp_path):
    """A Hugging Face config's attention_dropout and router_aux_loss_coef (and no hidden dropout) are the
    fine-tune's where the command line sets none (printed); a flag typed wins, even at Megatron's default."""
    from moezero.training.resume import apply_checkpoint_args, find_resume_point
    from tests.integration.pretrain_utils import configs

    hub, ckpt = str(tmp_path / "hub"), str(tmp_path / "ckpt")
    tiny_model("qwen3_moe", seed=3, attention_dropout=0.0, router_aux_loss_coef=0.02).float().save_pretrained(hub)
    _tool("import", hub, ckpt)
    base = [
        "--load",
        ckpt,
        "--use-checkpoint-args",
        "--finetune",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "96",
        "--seq-length",
        "16",
    ]
    cfg = configs(base)
    report = []
    taken = apply_checkpoint_args(cfg, find_resume_point(cfg.checkpoint), report.append)
    assert (taken.model.hidden_dropout, taken.model.attention_dropout, taken.moe.aux_loss_coeff) == (0.0, 0.0, 0.02)
    assert report == []  # taken where nothing was typed: no "command line" value to name (issue 71)
    cfg = configs(base + ["--attention-dropout", "0.1", "--moe-aux-loss-coeff", "0"])
    typed = apply_checkpoint_args(cfg, find_resume_point(cfg.checkpoint), report.append)
    assert (typed.model.hidden_dropout, typed.model.attention_dropout, typed.moe.aux_loss_coeff) == (0.0, 0.1, 0.0)


def test_import_and_export_a_piece_at_a_time(tmp_path):
    """Import in pieces of a few rows (an expert stack in whole experts), export in files of 40 KB: the Hub
    tensors come back bitwise (FP8-free DeepSeek-V3, its router bias a buffer) and the run reads the pieces."""
    import os

    from moezero.checkpoint import CheckpointReader
    from moezero.hf.checkpoint_conversion import import_hub

    hub, ckpt, back = str(tmp_path / "hub"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    tiny_model("deepseek_v3", seed=9).float().save_pretrained(hub)
    import_hub(hub, ckpt, piece_bytes=4096)
    reader = CheckpointReader(os.path.join(ckpt, "iter_0000000"))
    assert len(reader.ranges("embedding.weight")) == 4, "the embedding is written in several pieces"
    assert len(reader.ranges("layers.1.mlp.experts.w1")) > 1, "an expert stack too"
    _tool("export", ckpt, back, "--max-shard-size", "40KB")
    files = [n for n in os.listdir(back) if n.endswith(".safetensors")]
    original, exported = hub_tensors(hub), hub_tensors(back)
    assert len(files) > 3 and all(os.path.getsize(os.path.join(back, n)) < 60_000 for n in files)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    torch.testing.assert_close(
        hf_logits(load_with_transformers(back), PROBE), hf_logits(load_with_transformers(hub), PROBE), rtol=0, atol=0
    )


def test_save_hf_refuses_at_start_what_it_could_not_write(tmp_path):
    """--save-hf of a model no Hugging Face family holds, or with QAT's reparametrized weights, is refused when
    the run is built, not after the training; the end's folder is a finished run's."""
    from moezero.config import ConfigError
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import TINY, configs

    common = TINY + ["--save-hf", str(tmp_path / "hf"), "--data-cache-path", str(tmp_path / "cache")]
    with pytest.raises(ConfigError, match="--save-hf=.*no Hugging Face family holds this model"):
        pretraining(configs(common))
    llama = [
        "--swiglu",
        "--disable-bias-linear",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--untie-embeddings-and-output-weights",
    ]
    with pytest.raises(ConfigError, match="--save-hf=.*QAT"):
        pretraining(configs(common + llama + ["--qat-weight-bits", "4", "--qat-groups", "16"]))
    # only a finished run writes its last folder: a stopped one's time goes to --save's checkpoint
    stopped = pretraining(configs(common + llama + ["--train-iters", "4", "--exit-interval", "2"]))
    stopped.train()
    stopped.groups.destroy()
    assert stopped.stop_reason is not None and not (tmp_path / "hf").exists()
    finished = pretraining(configs(common + llama + ["--train-iters", "2"]))
    finished.train()
    finished.groups.destroy()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["iter_0000002"]


def test_a_qat_checkpoint_exports_its_fp32_masters_only_when_asked(tmp_path):
    """A QAT run's checkpoint holds fp32 masters, not the quantized weights its forward used: the export refuses
    by name (transformers would run another model than the one trained) unless --qat-masters says so."""
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import TINY, configs

    llama = [
        "--swiglu",
        "--disable-bias-linear",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--untie-embeddings-and-output-weights",
    ]
    ckpt = str(tmp_path / "ckpt")
    run_ = pretraining(
        configs(
            TINY
            + llama
            + [
                "--qat-weight-bits",
                "4",
                "--qat-groups",
                "16",
                "--train-iters",
                "1",
                "--save",
                ckpt,
                "--data-cache-path",
                str(tmp_path / "cache"),
            ]
        )
    )
    run_.train()
    run_.groups.destroy()
    refused = tool_in_process("hf_checkpoint", ["export", ckpt, str(tmp_path / "hf")])
    assert refused.returncode == 2 and "trained with QAT (--qat-weight-bits 4)" in refused.stderr, refused.stderr
    _tool("export", ckpt, str(tmp_path / "hf"), "--qat-masters")
    assert os.path.isfile(tmp_path / "hf" / "config.json")


def test_an_export_of_a_run_from_scratch_names_the_runs_tokens(tmp_path):
    """A model trained from scratch has no source config: its export (tools' and --save-hf's) names the run's
    end-of-document token as eos and no bos/pad, where the family's class defaults (Mixtral: bos 1, eos 2) would
    make transformers' generate stop at another token; it warns that transformers routes without the run's
    capacity factor. An --hf-config of another model (biased MLPs here, which
    transformers would build and leave random) is refused in one line."""
    from moezero.data import ByteLevelTokenizer
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import TINY, configs

    llama = [
        "--swiglu",
        "--disable-bias-linear",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--untie-embeddings-and-output-weights",
    ]
    ckpt, out, saved_hf = str(tmp_path / "ckpt"), str(tmp_path / "out"), str(tmp_path / "hf")
    run_ = pretraining(
        configs(
            TINY
            + llama
            + [
                "--train-iters",
                "1",
                "--save",
                ckpt,
                "--save-hf",
                saved_hf,
                "--data-cache-path",
                str(tmp_path / "cache"),
            ]
        )
    )
    run_.train()
    run_.groups.destroy()
    exported = _tool("export", ckpt, out)
    assert "capacity factor (1.5" in exported.stderr and "routes every token" in exported.stderr  # TINY's
    eod = ByteLevelTokenizer.eod
    for folder in (out, os.path.join(saved_hf, "iter_0000001")):
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, eod, None)
        generation = load_with_transformers(folder).generation_config
        assert (generation.eos_token_id, generation.bos_token_id) == (eod, None), folder

    base = dict(config, mlp_bias=True)
    with open(tmp_path / "base.json", "w") as f:
        json.dump(base, f)
    refused = tool_in_process(
        "hf_checkpoint", ["export", ckpt, str(tmp_path / "other"), "--hf-config", str(tmp_path / "base.json")]
    )
    lines = refused.stderr.strip().splitlines()
    assert (
        refused.returncode == 2
        and "describes another model than this one" in lines[-1]
        and "mlp_bias" in lines[-1]
        and "Traceback" not in refused.stderr
    ), refused.stderr
    assert not (tmp_path / "other").exists()
    refused = tool_in_process("hf_checkpoint", ["export", ckpt, str(tmp_path / "other"), "--family", "mixtrall"])
    assert (
        refused.returncode == 2
        and "family 'mixtrall': no such Hugging Face family (one of mixtral," in refused.stderr.strip().splitlines()[-1]
    ), refused.stderr


def test_an_import_resumes_without_finetune_as_a_requeued_job_does(tmp_path):
    """`--load CKPT --save CKPT` on an import (a requeue script's first start, no --finetune): the import holds
    no optimizer state (the run's weight-decay groups are its own), so the run starts fresh from its weights at
    iteration 0, with the losses of a --finetune run; it once failed on the import's one param group."""
    from moezero import checkpoint
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import configs

    hub, ckpt = str(tmp_path / "hub"), str(tmp_path / "ckpt")
    tiny_model("qwen3_moe", seed=3).float().save_pretrained(hub)
    _tool("import", hub, ckpt)
    losses = []
    for extra in (["--load", ckpt, "--finetune"], ["--load", ckpt, "--save", ckpt]):
        run_ = pretraining(configs(RUN + extra + ["--data-cache-path", str(tmp_path / "cache")]))
        run_.train()
        run_.groups.destroy()
        losses.append([h["lm_loss"] for h in run_.history])
    assert losses[0] == losses[1] and len(losses[0]) == 3
    assert checkpoint.saved_iterations(ckpt) == [0, 3]


def test_load_hf_of_a_folder_moezero_cannot_read_is_one_error_naming_the_flag(tmp_path):
    """--load-hf of a config moezero does not reproduce (a Mixtral sliding window) or of no Hub folder at all is a
    ConfigError naming the flag (the job prints it in one line, exit 2), as the import tool refuses it."""
    from moezero.config import ConfigError
    from moezero.recipe import pretraining
    from tests.integration.pretrain_utils import configs

    hub = str(tmp_path / "hub")
    tiny_model("mixtral", seed=3).float().save_pretrained(hub)
    with open(os.path.join(hub, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(hub, "config.json"), "w") as f:
        json.dump(dict(config, sliding_window=8), f)
    common = [a for a in RUN if a != "--use-checkpoint-args"] + ["--data-cache-path", str(tmp_path / "cache")]
    with pytest.raises(ConfigError, match=r"--load-hf=.*hub: mixtral config sliding_window=8: not supported"):
        pretraining(configs(common + ["--load-hf", hub]))
    with pytest.raises(ConfigError, match=r"--load-hf=.*nowhere: no config.json"):
        pretraining(configs(common + ["--load-hf", str(tmp_path / "nowhere")]))


def test_a_kept_field_by_its_other_name_gives_way_to_the_written_one(tmp_path):
    """A source config spelling the expert count by its config class's other name (num_local_experts, as
    transformers 5 saves Qwen3-MoE) would be the one transformers reads over the family's num_experts: the export
    writes one name only, and transformers builds the model that was saved."""
    from moezero.hf import from_pretrained, save_pretrained

    hub, out = str(tmp_path / "hub"), str(tmp_path / "out")
    tiny_model("qwen3_moe", seed=4).float().save_pretrained(hub)
    model = from_pretrained(hub)
    experts = model.moe_config.num_experts
    source = {k: v for k, v in model.hub_config.items() if k != "num_experts"}
    model.hub_config = dict(source, num_local_experts=2 * experts)  # another model's count, by the other name
    save_pretrained(model, out)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert written["num_experts"] == experts and "num_local_experts" not in written
    torch.testing.assert_close(
        hf_logits(load_with_transformers(out), PROBE), hf_logits(load_with_transformers(hub), PROBE), rtol=0, atol=0
    )
