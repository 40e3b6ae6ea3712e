#!/usr/bin/env python
"""Peak memory of Hugging Face checkpoints in and out, against the checkpoint's size.

    python tools/bench_hf_memory.py [--hidden 512] [--experts 16] [--layers 4] [--shard-mb 64]

Writes a bf16 Mixtral-layout Hub folder (shards of --shard-mb), then measures, each in a fresh process, the peak
RSS above the process's own after its imports: tools/hf_checkpoint.py import and export (which stream a piece at
a time), a rank's start from the folder on 2 ranks (ep 2, ZeRO stage 3, what --load-hf does), and the whole-model
load a one-process import used to be (from_pretrained, eager), for scale. Also lazy against eager on one process
(stage 0). The bound to compare with: about one shard file plus what the rank keeps.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _peak_mb() -> float:
    """This process's peak RSS (VmHWM: getrusage's ru_maxrss would keep the parent's peak across exec)."""
    return _status_mb("VmHWM")


def _write_hub(path, hidden, experts, layers, shard_mb):
    import torch
    from moezero.hf import save_pretrained
    from moezero.hf.families import FAMILIES
    from moezero.models import GPTModel

    config = {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }
    gpt, moe = FAMILIES["mixtral"].configs(config)
    model = GPTModel(gpt, moe).to(torch.bfloat16)
    save_pretrained(model, path, max_shard_bytes=shard_mb << 20)


def _child(task, hub, work):
    """One measurement in this process: prints {"base": MB, "peak": MB, ...} as JSON."""
    import torch
    from moezero.hf import from_pretrained
    from moezero.parallel import ParallelGroups
    from moezero.zero import ZeroOptimizer
    from moezero.hf.checkpoint_conversion import export_checkpoint, import_hub

    base = _rss_mb()
    extra = {}
    if task == "import":
        import_hub(hub, os.path.join(work, "ckpt"))
    elif task == "export":
        export_checkpoint(
            os.path.join(work, "ckpt"),
            os.path.join(work, "back"),
            overwrite=True,
            max_shard_bytes=int(os.environ["SHARD_MB"]) << 20,
        )
    elif task in ("eager", "lazy"):
        model = from_pretrained(hub, lazy=task == "lazy")
        opt = ZeroOptimizer(model, torch.optim.AdamW, ParallelGroups.single(), stage=0)
        extra["kept_mb"] = sum(opt.memory_bytes().values()) / 2**20
    elif task == "eager_whole":
        from_pretrained(hub, dtype=torch.float32)
    print(json.dumps(dict(base=base, peak=_peak_mb(), **extra)))


def _rank(rank, hub, port, out):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from moezero.hf import from_pretrained
    from moezero.parallel import ParallelGroups
    from moezero.zero import ZeroOptimizer

    groups = ParallelGroups.build(expert_parallel_size=2)
    base = _rss_mb()
    model = from_pretrained(hub, groups=groups, lazy=True)
    opt = ZeroOptimizer(model, torch.optim.AdamW, groups, stage=3)
    kept = sum(opt.memory_bytes().values()) / 2**20
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"base": base, "peak": _peak_mb(), "kept_mb": kept}, f)
    groups.destroy()
    dist.destroy_process_group()


def _measure(task, hub, work, shard_mb):
    proc = subprocess.run(
        [sys.executable, __file__, "--child", task, hub, work],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", SHARD_MB=str(shard_mb)),
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure_ranks(hub, work):
    import torch.multiprocessing as mp

    out = os.path.join(work, "rank")
    mp.spawn(_rank, args=(hub, 29400 + os.getpid() % 500, out), nprocs=2)
    return [json.load(open(f"{out}.{r}")) for r in range(2)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    with tempfile.TemporaryDirectory() as work:
        hub = os.path.join(work, "hub")
        _write_hub(hub, args.hidden, args.experts, args.layers, args.shard_mb)
        files = [n for n in os.listdir(hub) if n.endswith(".safetensors")]
        size = sum(os.path.getsize(os.path.join(hub, n)) for n in files) / 2**20
        shard = max(os.path.getsize(os.path.join(hub, n)) for n in files) / 2**20
        print(
            f"Hub folder: {size:.0f} MB bf16 in {len(files)} files (largest {shard:.0f} MB); fp32 model "
            f"{2 * size:.0f} MB"
        )
        print(f"{'what (peak RSS above the process after imports)':58s} {'MB':>7s} {'/ ckpt':>7s}")
        rows = [
            ("import, streamed (tools/hf_checkpoint.py import)", _measure("import", hub, work, args.shard_mb)),
            ("export, streamed (export, --max-shard-size = the shards)", _measure("export", hub, work, args.shard_mb)),
            ("whole model in fp32 (what import used to hold)", _measure("eager_whole", hub, work, args.shard_mb)),
            ("one process, eager load + ZeRO-0", _measure("eager", hub, work, args.shard_mb)),
            ("one process, lazy load + ZeRO-0", _measure("lazy", hub, work, args.shard_mb)),
        ]
        for r, result in enumerate(_measure_ranks(hub, work)):
            rows.append((f"rank {r} of 2, lazy load + ZeRO-3 ep 2 (--load-hf)", result))
        for what, m in rows:
            grown = m["peak"] - m["base"]
            kept = f"  (keeps {m['kept_mb']:.0f} MB)" if "kept_mb" in m else ""
            print(f"{what:58s} {grown:7.0f} {grown / size:7.2f}{kept}")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
