"""Benchmark worker (run under torchrun): train a GPT(-MoE) for N steps with one system, print RESULT json.

Systems: moezero (ZeroOptimizer, stage 0/1/2, any ep), ddp (torch DDP + AdamW), torch_zero (DDP +
torch's ZeroRedundancyOptimizer). The data is the same learnable synthetic stream the DeepSpeed
worker uses (bench/synthetic.py), so losses compare across systems.
"""

import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moezero import phases  # noqa: E402

from memtrace import sample as memory_sample  # noqa: E402
from moezero_gpt import STYLES, build_moezero_gpt, lm_loss, use_torch_elementwise_ops  # noqa: E402
from synthetic import (
    adamw_kwargs,
    batch,
    common_parser,
    gemm_peak_flops,
    kernel_paths,  # noqa: E402
    model_flops_per_token,
)


def parse():
    p = common_parser()
    p.add_argument("--system", choices=["moezero", "ddp", "torch_zero"], default="moezero")
    p.add_argument(
        "--late-first-bucket",
        action="store_true",
        help="add a param registered last (so it lands in bucket 0) but used first in forward",
    )
    p.add_argument("--profile", default="", help="write a torch.profiler chrome trace of one step here")
    p.add_argument(
        "--gemm-steps",
        type=int,
        default=0,
        help="after the timed steps, profile this many more and report the time in matrix products",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="split each rank's --mb sequences into this many micro-batches (gradient accumulation)",
    )
    p.add_argument(
        "--overlap-moe-comm",
        action="store_true",
        help="micro-batches in pairs, their forwards interleaved (moezero's --overlap-moe-expert-parallel-comm)",
    )
    p.add_argument(
        "--delay-wgrad-compute",
        action="store_true",
        help="the experts' weight gradients after the rows' all-to-all back is launched (with --overlap-moe-comm)",
    )
    p.add_argument(
        "--no-agreement-messages",
        action="store_true",
        help="measurement only (moezero): the ranks' agreement records send no message (those riding on "
        "the MoE exchanges stay), so a step shows what the messages cost in it; ranks that disagree are "
        "then not caught",
    )
    p.add_argument(
        "--gloo-records",
        action="store_true",
        help="measurement only (moezero): agreement records and short all-reduces on gloo, as between "
        "ranks on several hosts, instead of the pipes ranks on one host use (local_channel.py)",
    )
    p.add_argument(
        "--style",
        choices=sorted(STYLES),
        default="peer",
        help="the layers: the peer model's (LayerNorm, GELU, biases), Llama's (RMSNorm, SwiGLU, no biases) "
        "or GPT-OSS's (RMSNorm, quick GEGLU with offset 1 and clamp 7, biases)",
    )
    p.add_argument(
        "--torch-elementwise",
        action="store_true",
        help="measurement only (moezero): torch's ops instead of the element-wise CPU kernels (bias + GELU, "
        "bias add, RMSNorm, SwiGLU, quick GEGLU)",
    )
    return p.parse_args()


def build_model(args, groups):
    model = build_moezero_gpt(args, groups)
    if args.late_first_bucket:
        # its gradient arrives at the very end of backward, and buckets launch strictly in order
        model.late = torch.nn.Parameter(torch.zeros(args.hidden, dtype=model.embedding.weight.dtype))
        model.embedding.register_forward_hook(lambda module, inputs, out: out + model.late)
    return model


def build_optimizer(args, model, groups):
    kwargs = adamw_kwargs(args)
    if args.system == "moezero":
        from moezero.zero import ZeroOptimizer

        return model, ZeroOptimizer(
            model,
            torch.optim.AdamW,
            groups,
            stage=args.stage,
            bucket_size=args.bucket,
            overlap_comm=not args.no_overlap,
            clip_grad=1.0,
            min_unit_params=args.min_unit_params,
            **kwargs,
        )
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket * 4 / 2**20)
    if args.system == "ddp":
        return ddp, torch.optim.AdamW(model.parameters(), **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ddp, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **kwargs)


def train_step(args, model, opt, step, rank, heap=None):
    tokens, labels = batch(args, step, rank)
    pieces = list(zip(tokens.chunk(args.micro_batches), labels.chunk(args.micro_batches)))
    together = 2 if args.overlap_moe_comm else 1
    ce = 0.0
    for first in range(0, len(pieces), together):
        group = pieces[first : first + together]
        if len(group) > 1:
            outputs = phases.run_interleaved([phases.module_steps(model, t) for t, _ in group])
        else:
            outputs = [model(group[0][0])]
        losses = [lm_loss(output, y) for output, (_, y) in zip(outputs, group)]
        sum(loss for _, loss in losses).div(len(pieces)).backward()
        ce = ce + sum(c.detach() for c, _ in losses) / len(pieces)
        output = outputs[-1]
    backward_done = time.perf_counter()
    if args.system != "moezero":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if heap is not None:
        heap.after_step()
    opt.zero_grad()
    return ce.detach(), time.perf_counter() - backward_done, expert_assignments(output)


def expert_assignments(output):
    """(MoE layers, experts) int64: this rank's routed assignments per expert (None for a dense model)."""
    if not isinstance(output, tuple) or not output[1]:
        return None
    return torch.stack([s.tokens_per_expert.detach() for s in output[1]])


def slowest_rank_load(assignments, groups):
    """The expert rows of the busiest rank of the expert-parallel group over the group's mean, averaged over the
    MoE layers: the work the other ranks wait for at each layer's all-to-all (1.0 when balanced or ep 1)."""
    if assignments is None or groups.ep_size == 1:
        return 1.0
    received = assignments.clone()
    dist.all_reduce(received, group=groups.ep)  # each expert's rows: the sum of every rank's assignments
    per_rank = received.view(received.shape[0], groups.ep_size, -1).sum(-1).double()
    return (per_rank.max(1).values / per_rank.mean(1)).mean().item()


# the kernels that do a training step's matrix products (SDPA's fused attention: its products and softmax)
MATRIX_PRODUCT_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)


def matrix_product_seconds(args, model, opt, rank, first_step, heap):
    """Seconds per step this rank spends inside matrix-product kernels, over `--gemm-steps` profiled steps."""
    from torch.profiler import profile

    with profile() as prof:
        for step in range(first_step, first_step + args.gemm_steps):
            train_step(args, model, opt, step, rank, heap)
    self_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in MATRIX_PRODUCT_OPS)
    return self_us / 1e6 / args.gemm_steps


def cpu_seconds():
    """(this thread's CPU seconds, the whole process's: every thread, user and system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.clock_gettime(time.CLOCK_THREAD_CPUTIME_ID), usage.ru_utime + usage.ru_stime


def agreement_of(opt):
    """The optimizer's agreement records (moezero), or None."""
    engine = getattr(opt, "engine", None)
    return getattr(engine, "agreement", None)


def agreement_message_cpu_s(agreement, messages=500):
    """Process CPU seconds (every thread) one agreement message costs a rank here, timed on the optimizer's own
    agreement group after training: what a step's messages cost, apart from any wait for a peer."""
    from moezero.parallel.agreement import RECORDS_PER_MESSAGE, Agreement

    records = [agreement.record(1, 1)] * RECORDS_PER_MESSAGE  # any record: a message costs the same whatever it says
    dist.barrier()
    start = cpu_seconds()[1]
    for _ in range(messages):
        Agreement(records, agreement.group, agreement.describe).check()
    return (cpu_seconds()[1] - start) / messages


def gathered(value, world):
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return [v.item() for v in values]


def max_over_ranks(value, world):
    return max(gathered(value, world))


def main():
    args = parse()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.torch_elementwise:
        use_torch_elementwise_ops()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from moezero.parallel import ParallelGroups

    groups = ParallelGroups.build(expert_parallel_size=args.ep, local_records=not args.gloo_records)
    peak = gemm_peak_flops() if args.peak else None
    model, opt = build_optimizer(args, build_model(args, groups), groups)
    if args.no_agreement_messages and agreement_of(opt) is not None:
        agreement_of(opt).group = None  # every record is then checked against this rank's own only
    heap = None
    if args.system == "moezero":  # the host heap policy moezero's training loop applies (--host-heap-policy)
        from moezero.training.host_memory import HeapTrimmer

        heap = HeapTrimmer()
    losses, times, opt_times, memory, main_cpu, process_cpu, loads = [], [], [], [], [], [], []
    agreement, messages = agreement_of(opt), []
    for step in range(args.steps):
        launched = agreement.launched if agreement is not None else 0
        dist.barrier()
        cpu_start = cpu_seconds()
        start = time.perf_counter()
        if args.profile and step == args.steps - 1:
            from torch.profiler import profile

            with profile(record_shapes=False) as prof:
                ce, opt_s, assignments = train_step(args, model, opt, step, rank, heap)
            if rank == 0:
                prof.export_chrome_trace(args.profile)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
        else:
            ce, opt_s, assignments = train_step(args, model, opt, step, rank, heap)
        times.append(time.perf_counter() - start)
        cpu_end = cpu_seconds()
        main_cpu.append(cpu_end[0] - cpu_start[0])
        process_cpu.append(cpu_end[1] - cpu_start[1])
        opt_times.append(opt_s)
        memory.append(memory_sample())
        dist.all_reduce(ce)
        losses.append(ce.item() / world)
        loads.append(slowest_rank_load(assignments, groups))
        messages.append((agreement.launched if agreement is not None else 0) - launched)
    timed = slice(args.warmup, None) if len(times) > args.warmup else slice(None)
    step_s, opt_s = statistics.median(times[timed]), statistics.median(opt_times[timed])
    # where a rank's step goes: its main thread on a core, the other threads (gloo's transport) on a core
    main_cpu_s = gathered(statistics.median(main_cpu[timed]), world)
    other_threads_cpu_s = gathered(statistics.median(p - m for p, m in zip(process_cpu[timed], main_cpu[timed])), world)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    rss_all = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(rss_all, rss)
    gemm_s = None
    if args.gemm_steps:  # after the peak RSS was read: the profiler's own memory is not the run's
        gemm_s = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(
            gemm_s,
            torch.tensor([matrix_product_seconds(args, model, opt, rank, args.steps, heap)], dtype=torch.float64),
        )
    peaks = None
    if peak is not None:
        peaks = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(peaks, torch.tensor([peak]))
    tokens = args.mb * args.seq * world
    result = {
        "tag": args.tag,
        "system": args.system,
        "stage": args.stage,
        "ep": args.ep,
        "world": world,
        "step_s": step_s,
        "optimizer_s": opt_s,
        "tokens_per_s": tokens / step_s,
        "peak_rss_mb": [r.item() for r in rss_all],
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "losses": losses,
        "flops_per_token": model_flops_per_token(args),
        "times": times,
        "memory": memory if rank == 0 else None,
        "optimizer_bytes": opt.memory_bytes() if hasattr(opt, "memory_bytes") else None,
        "rss_end_mb": max_over_ranks(memory[-1]["rss_mb"], world),
        "kernel_paths": kernel_paths(),
        "main_thread_cpu_s_per_rank": main_cpu_s,
        "other_threads_cpu_s_per_rank": other_threads_cpu_s,
        "slowest_rank_expert_load": statistics.median(loads[timed]),
        "agreement_messages_per_step": statistics.median(messages[timed]),
    }
    if agreement is not None and agreement.group is not None:
        result["agreement_message_cpu_s"] = max_over_ranks(agreement_message_cpu_s(agreement), world)
    if gemm_s is not None:
        result["matrix_product_s_per_rank"] = [g.item() for g in gemm_s]
    if peaks is not None:
        result["gemm_peak_flops"] = sum(p.item() for p in peaks)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    groups.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
