"""One rank of the tensor-parallel benchmark (under torchrun): a transformer MLP block and the output layer with its
loss, built from moezero's tensor-parallel layers over a group of every rank (at one rank: the same layers, no
exchange), forward and backward timed, and the time inside the layers' exchanges timed from outside the code
(a timing proxy in place of the `comm` module the regions and the vocab-parallel loss call).

    python -m torch.distributed.run --nproc_per_node=2 tools/bench/tp_worker.py --hidden 512 [--sequence-parallel]

The group is served as moezero serves a group whose ranks share a host (local_transport.py). Prints one line
`RESULT {json}` on rank 0: step_s (median fwd+bwd, the slowest rank's), exchange_s (the median
time in the exchanges, the slowest rank's), params (one rank's).
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from comm_timing import time_collectives_of
from moezero.parallel import local_channel, local_exchange
from moezero.parallel.local_transport import LocalTransport
from moezero.parallel.transport import serve
from moezero.parallel.tp_linear import ColumnParallelLinear, RowParallelLinear
from moezero.parallel.vocab_parallel import vocab_parallel_cross_entropy


class Block(torch.nn.Module):
    """x + fc2(gelu-GLU(fc1(norm(x)))) then the output layer: Megatron's MLP and head under tp (SP: the norm and the
    residual on the rank's sequence shard)."""

    def __init__(self, hidden: int, ffn: int, vocab: int, group, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn, group, parts=(ffn, ffn), sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(ffn, hidden, group, sequence_parallel=sequence_parallel)
        self.head = ColumnParallelLinear(hidden, vocab, group, bias=False, sequence_parallel=sequence_parallel)

    def forward(self, x, target):
        gate, up = self.fc1(self.norm(x)).chunk(2, dim=-1)
        x = x + self.fc2(F.gelu(gate) * up)
        return vocab_parallel_cross_entropy(self.head(x), target, self.group).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world))) if world > 1 else None
    if group is not None:  # as ParallelGroups serves a group on one host: pipes and shared-memory rings
        pipes = local_channel.connect(group, None, "tensor-parallel group")
        serve(group, LocalTransport(group, pipes, local_exchange.connect(group, pipes)))
    timer = time_collectives_of("moezero.parallel.tp_regions", "moezero.parallel.vocab_parallel")
    torch.manual_seed(0)
    model = Block(args.hidden, args.ffn, args.vocab, group, args.sequence_parallel)
    seq = args.seq // world if args.sequence_parallel else args.seq
    x = torch.randn(args.batch, seq, args.hidden, requires_grad=True)
    target = torch.randint(args.vocab, (args.batch, args.seq))
    steps, exchanges = [], []
    for _ in range(args.warmup + args.steps):
        timer.seconds = 0.0
        start = time.perf_counter()
        model(x, target).backward()
        steps.append(time.perf_counter() - start)
        exchanges.append(timer.seconds)
    mine = {
        "step_s": statistics.median(steps[args.warmup :]),
        "exchange_s": statistics.median(exchanges[args.warmup :]),
        "params": sum(p.numel() for p in model.parameters()),
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        result = {key: max(r[key] for r in every) for key in ("step_s", "exchange_s")}
        print("RESULT " + json.dumps(dict(result, params=every[0]["params"])), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
