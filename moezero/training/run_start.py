"""What a run starts from, decided from its flags before anything is built: the checkpoint it resumes, the
model a Hub folder (--load-hf) or the checkpoint (--use-checkpoint-args) defines, the dense checkpoint
--moe-use-upcycling starts the experts from. The pretraining script and the docs' command checks call it,
so a launch line shown in the docs is resolved exactly as the script resolves it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from moezero.checkpoint import latest_iteration
from moezero.config import ConfigError
from moezero.hf import CheckpointMismatch, UnsupportedModel, run_configs
from moezero.models.upcycling import check_upcyclable
from moezero.training.configs import Configs, moe_comm_overlap_notices, recompute_notices
from moezero.training.resume import (
    ResumePoint,
    apply_checkpoint_args,
    apply_hub_configs,
    check_same_model,
    check_save_folder,
    find_resume_point,
    upcycling_point,
)


@dataclass
class RunStart:
    cfg: Configs  # the flags, with the model a Hub folder or checkpoint defines
    point: Optional[ResumePoint]  # the checkpoint the run resumes from (None: a new run)
    hub_config: Optional[Dict[str, Any]]  # the Hub config the model came from (--load-hf), if any
    hub_generation_config: Optional[Dict[str, Any]] = None  # and its generation_config.json, if any
    dense_source: Optional[ResumePoint] = None  # --moe-use-upcycling: the dense checkpoint of the experts
    notices: List[str] = field(default_factory=list)  # lines for the run's log


def resolve_start(cfg: Configs) -> RunStart:
    notices: List[str] = []
    own = _upcycled_runs_own_checkpoint(cfg)
    if own is None:  # an upcycled run requeued resumes its --save, which is not its (dense) --load
        check_save_folder(cfg.checkpoint)
    upcycling = cfg.moe.use_upcycling and own is None
    point = own or find_resume_point(cfg.checkpoint)
    if own is not None:
        notices.append(
            f" --moe-use-upcycling: resuming from the run's own checkpoint {own.path}, not upcycling "
            f"{cfg.checkpoint.load} again"
        )
    hub = cfg.checkpoint.load_hf
    hub_config = point.configs.get("hf") if point is not None else None
    hub_generation = point.configs.get("hf_generation") if point is not None else None
    if hub is not None:  # the Hub folder says what the model is, resumed or not
        hub_configs = _hub_run_configs(hub)
        cfg = apply_hub_configs(cfg, hub, hub_configs, notices.append)
        hub_config, hub_generation = hub_configs["hf"], hub_configs.get("hf_generation")
        if point is not None:
            notices.append(f" --load-hf: resuming from the run's own checkpoint {point.path}, not {hub}")
    if point is not None and upcycling:
        point = upcycling_point(point, cfg.model, cfg.moe, notices.append)
    if point is not None and cfg.checkpoint.use_checkpoint_args:
        cfg = apply_checkpoint_args(cfg, point, notices.append)
    elif point is not None:
        check_same_model(cfg, point)
    elif cfg.checkpoint.load:
        start = f"starting from the Hugging Face model --load-hf={hub}" if hub is not None else "training from scratch"
        notices.append(f" no checkpoint in --load={cfg.checkpoint.load} yet (it is also --save): {start}")
    notices += moe_comm_overlap_notices(cfg) + recompute_notices(cfg)
    dense_source = None
    if point is not None and upcycling:
        check_upcyclable(cfg.model, cfg.moe)
        dense_source, point = point, None  # a new run: iteration 0, fresh optimizer, as --finetune
    return RunStart(cfg, point, hub_config, hub_generation, dense_source, notices)


def _upcycled_runs_own_checkpoint(cfg: Configs) -> Optional[ResumePoint]:
    """--moe-use-upcycling run again (a requeued job) once it has saved: the latest checkpoint in --save, which the
    run resumes (upcycling the dense --load again would start over at 0 and overwrite its saves)."""
    ckpt = cfg.checkpoint
    if not cfg.moe.use_upcycling or ckpt.save is None or latest_iteration(ckpt.save) is None:
        return None
    own = find_resume_point(dataclasses.replace(ckpt, load=ckpt.save, ckpt_step=None))
    if not (own.configs.get("moe") or {}).get("num_experts"):  # --save is also the dense --load: not saved yet
        return None
    return own


def _hub_run_configs(hub: str) -> Dict[str, Dict[str, Any]]:
    """--load-hf's configs; a folder moezero cannot read is one line naming the flag (as the import tool's)."""
    try:
        return run_configs(hub)
    except (UnsupportedModel, CheckpointMismatch, FileNotFoundError) as exc:
        raise ConfigError(f"--load-hf={hub}: {exc}") from None
