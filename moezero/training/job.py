"""Process-group setup and the exit codes of a pretraining job.

    sys.exit(run(cfg, plugins))   # 0 done (or stopped and saved: a signal with --exit-signal-handler,
                                  # --exit-duration-in-mins, --exit-interval; or nothing left to train),
                                  # 2 bad configuration, data or checkpoint, 130 Ctrl-C, 1 a peer died

Launched by `torchrun --nproc_per_node=N ...`; one process without torchrun works too (a world of one).
"""

from __future__ import annotations

import datetime
import os
import sys
from types import MappingProxyType
from typing import Mapping

import torch
import torch.distributed as dist

from moezero import checkpoint
from moezero.checkpoint import CheckpointError
from moezero.checkpoint.errors import first_line
from moezero.config import ConfigError
from moezero.data import DataError
from moezero.parallel import ChannelError
from moezero.parallel.agreement import RanksDisagree
from moezero.pipeline.failure import PipelineFailed
from moezero.training.configs import Configs
from moezero.training.plugin import PluginFactory
from moezero.training.pretrain import Pretraining


def init_distributed(backend: str, timeout_minutes: float) -> None:
    """Join the torchrun world with --distributed-backend; nccl on a machine without CUDA runs gloo (Megatron's
    default is nccl, and moezero trains on CPUs too). One process joins only with nccl on a CUDA machine, a
    world of one as Megatron's, so that it trains on its GPU (the model follows the backend's device).

    Under torchrun each restart attempt (`--max-restarts`) keys its process groups in torchrun's store under a
    prefix of its own: the store outlives the workers, and a restarted rank would otherwise read the address a
    dead rank of the previous attempt published and fail to connect (gloo's "connectFullMesh ... Connection
    refused"), or succeed only when the new rank happened to publish first."""
    if dist.is_initialized():
        return
    one_gpu = backend == "nccl" and torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not one_gpu:
        return
    if backend == "nccl" and not torch.cuda.is_available():
        backend = "gloo"
        if os.environ.get("RANK", "0") == "0":
            print(" --distributed-backend=nccl: no CUDA device here, using gloo", flush=True)
    options = {"timeout": datetime.timedelta(minutes=timeout_minutes)}
    if backend == "nccl":  # bound to its GPU from the start, as Megatron's (NCCL need not guess it from the rank)
        options["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(options["device_id"])
    if "MASTER_ADDR" not in os.environ:  # `python pretrain_gpt_moe.py` on a GPU machine: a world of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, **options)
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=options["timeout"]))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"moezero/attempt_{attempt}", store),
        rank=rank,
        world_size=world_size,
        **options,
    )


def run(cfg: Configs, plugins: Mapping[str, PluginFactory] = MappingProxyType({})) -> int:
    """Train with `cfg` and `plugins`; returns the process exit code, with one clear line on failure."""
    try:
        try:
            init_distributed(cfg.parallel.distributed_backend, cfg.train.dist_timeout_minutes)
        except (RuntimeError, ValueError, OSError) as exc:  # torch's DistError, DistNetworkError, DistStoreError
            _report(
                f"error: joining the process group failed ({first_line(exc)}); check MASTER_ADDR / MASTER_PORT "
                "(a port in use?), that every rank started, and --distributed-timeout-minutes",
                every_rank=True,
            )
            return 1
        Pretraining(cfg, plugins).train()
        return 0
    except (ConfigError, DataError, CheckpointError) as exc:
        _report(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        _report(interrupt_message(cfg.checkpoint.save), every_rank=True)
        return 130
    except FloatingPointError as exc:  # a non-finite step (the same on every rank: the norm is global)
        _report(f"error: {exc}")
        return 1
    except PipelineFailed as exc:  # one line naming the stage and rank that failed first, on every rank
        _report(f"error: {exc}", every_rank=True)
        return 1
    except RanksDisagree as exc:  # its message says where each rank was
        _report(f"error: {first_line(exc)}", every_rank=True)
        return 1
    except (RuntimeError, dist.DistBackendError) as exc:
        if _a_data_worker_died(exc):
            _report(
                f"error: a data-loading worker process ended ({first_line(exc)}); the system's out-of-memory "
                "killer? lower --num-workers (0 reads in the rank's own process)",
                every_rank=True,
            )
            return 1
        if not dist.is_initialized() or not (isinstance(exc, ChannelError) or _looks_like_peer_failure(exc)):
            raise
        _report(
            f"error: a collective failed ({str(exc).splitlines()[0][:200]}); another rank probably died or "
            "stopped answering. Exiting.",
            every_rank=True,
        )
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def interrupt_message(save_dir) -> str:
    """What an interrupted run left on disk, as it is (read back, not assumed)."""
    if not save_dir:
        return "interrupted; nothing was saved (no --save)"
    try:
        latest = checkpoint.latest_iteration(save_dir)
    except CheckpointError:
        latest = None
    last = (
        f"the last complete checkpoint is {checkpoint.iteration_dir(save_dir, latest)}"
        if latest is not None
        else f"no complete checkpoint in {save_dir}"
    )
    unfinished = checkpoint.unfinished_saves(save_dir)
    partial = (
        f"; the unfinished save {', '.join(unfinished)} is ignored by --load and removed by the next save"
        if unfinished
        else ""
    )
    return f"interrupted; {last}{partial} (--exit-signal-handler saves before exiting)"


def _a_data_worker_died(exc: BaseException) -> bool:
    """torch's words for a reader process that was killed (the OOM killer) or exited; not an error raised inside
    one ('Caught ... in DataLoader worker process 0', re-raised with its traceback)."""
    text = str(exc)
    return "DataLoader worker" in text and ("exited unexpectedly" in text or "is killed by signal" in text)


def _looks_like_peer_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("connection", "timed out", "timeout", "peer", "gloo", "nccl", "broken pipe"))


def _report(message: str, every_rank: bool = False) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 or every_rank:
        print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
