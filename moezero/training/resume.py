"""Which checkpoint a run resumes from, and whether it fits the run, decided before anything is built.

    point = find_resume_point(cfg.checkpoint)        # None: start from scratch (or a CheckpointError)
    progress = start_progress(point, finetune)       # the samples it consumed
    schedule, steps = start_lr_schedule(LearningRateSchedule.from_config(cfg.train), point, cfg.checkpoint,
                                        cfg.train)   # the lr schedule and where it stands (changed: refused)
    point = upcycling_point(point, cfg.model, cfg.moe, print)   # --moe-use-upcycling: a dense checkpoint as the
                                                               # MoE run's (which starts at 0, as --finetune)
    cfg = apply_checkpoint_args(cfg, point, print)   # --use-checkpoint-args
    check_same_model(cfg, point)                     # else: each differing flag, old and new value
    rows = adopted_vocabulary(point, tokenizer, padded, tp)  # the checkpoint's padded vocabulary, saved at another tp
    check_shapes(model, point)                       # the built model against the saved global shapes

Every rank reads the same files and decides the same, so a refusal is raised on all ranks alike
before any collective. A model-defining flag is one declared with `option(..., defines_model=True)`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from torch import nn

from moezero import checkpoint
from moezero.checkpoint import CheckpointError
from moezero.checkpoint.keys import plain_param_name
from moezero.config import ConfigError, DataConfig, GPTConfig, MoEConfig, flag_of, model_defining_fields
from moezero.config.options import derived_when_none_fields
from moezero.data import parse_data_path
from moezero.parallel import expert_shard_of
from moezero.parallel.tensor_marker import tensor_shard_of
from moezero.training.configs import TrainConfig
from moezero.training.lr_schedule import LearningRateSchedule, resumed_schedule

TOKENIZER_FILES = ("tokenizer_model", "vocab_file", "merge_file")  # taken from a checkpoint only when not given


@dataclass(frozen=True)
class ResumePoint:
    path: str  # the iter_N folder
    iteration: int
    configs: Dict[str, Dict[str, Any]]  # the sections the saving run stored
    param_shapes: Dict[str, Tuple[int, ...]]
    progress: Dict[str, int] = dataclasses.field(default_factory=dict)  # consumed samples (see Progress)
    lr_schedule: Dict[str, Any] = dataclasses.field(default_factory=dict)  # LearningRateSchedule.state()
    tensorboard_files: Optional[Tuple[str, ...]] = None  # its lineage's event files (None: saved before recorded)


@dataclass(frozen=True)
class Progress:
    """Where a run stands in its data, saved with each checkpoint (Megatron's consumed samples): the next
    step reads train samples from `consumed_train_samples` on, the next evaluation valid ones from
    `consumed_valid_samples`, whatever batch size the run had before. `train_dataset_samples`: the size
    the train split was built with, kept on resume where it suffices (the sample order depends on it).
    `skipped_iterations`: iterations whose step was not taken (fp16 overflows), kept whatever the optimizer
    state (--no-load-optim): the plug-ins' schedules count the steps taken."""

    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    train_dataset_samples: int = 0
    skipped_iterations: int = 0

    def saved(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


def find_checkpoint(ckpt) -> Optional[str]:
    """The iter_N folder that --load / --ckpt-step name, or None when --load is also --save and holds no
    checkpoint yet (Megatron's first-run idiom; not with --exit-on-missing-checkpoint). Anything else that holds
    no checkpoint is an error, and so are complete iter folders no pointer names (training from scratch would
    write over them)."""
    load = ckpt.load
    if load is None:
        return None
    if os.path.isfile(os.path.join(load, ".metadata")):
        if ckpt.ckpt_step is not None:
            raise ConfigError(f"--ckpt-step={ckpt.ckpt_step}: --load={load} is one checkpoint folder already")
        return load
    saved = checkpoint.saved_iterations(load)
    if ckpt.ckpt_step is not None:
        if ckpt.ckpt_step not in saved:
            raise CheckpointError(
                f"--ckpt-step={ckpt.ckpt_step}: --load={load} has no iter_{ckpt.ckpt_step:07d} "
                f"(saved iterations: {', '.join(map(str, saved)) or 'none'})"
            )
        return checkpoint.iteration_dir(load, ckpt.ckpt_step)
    latest = checkpoint.latest_iteration(load) if os.path.isdir(load) else None
    if latest is not None:
        return checkpoint.iteration_dir(load, latest)
    if saved:  # complete folders nobody published (a save whose pointer write failed, folders copied in)
        raise CheckpointError(
            f"--load={load}: holds iter folders {saved} but no {checkpoint.POINTER} naming one: "
            "resume one with --ckpt-step N, or move them away to start a new run there"
        )
    if getattr(ckpt, "exit_on_missing_checkpoint", False):
        raise CheckpointError(f"--load={load}: holds no checkpoint (--exit-on-missing-checkpoint)")
    if ckpt.save is not None and os.path.abspath(ckpt.save) == os.path.abspath(load):
        return None
    if not os.path.exists(load):
        raise CheckpointError(f"--load={load}: does not exist (for a first run, give the same path to --save)")
    raise CheckpointError(f"--load={load}: holds no checkpoint (no {checkpoint.POINTER})")


def check_save_folder(ckpt) -> None:
    """A --save other than --load that holds another run's checkpoints: this run would write over them (its
    iter_N, `latest`, the pruning of older ones), so it stops at start (--load's own folders are find_checkpoint's).
    Megatron writes over them without a word."""
    save, load = ckpt.save, ckpt.load
    if save is None or (
        load is not None and os.path.abspath(save) in (os.path.abspath(load), os.path.dirname(os.path.abspath(load)))
    ):
        return  # --load is --save, or one of its iter folders: resumed by name
    saved = checkpoint.saved_iterations(save)
    if not saved:
        return
    if not os.path.exists(os.path.join(save, checkpoint.POINTER)):
        raise CheckpointError(
            f"--save={save}: holds iter folders {saved} but no {checkpoint.POINTER} naming one, "
            "which this run would write over: resume one (--load the folder, --ckpt-step N), or "
            "save elsewhere"
        )
    raise CheckpointError(
        f"--save={save}: holds another run's checkpoints (iterations {saved}), which this run "
        f"would write over: resume that run (--load {save}), or save elsewhere"
    )


def find_resume_point(ckpt) -> Optional[ResumePoint]:
    path = find_checkpoint(ckpt)
    if path is None:
        return None
    state = checkpoint.read_train_state(path)
    files = state.get("tensorboard_files")
    return ResumePoint(
        path,
        int(state["iteration"]),
        state.get("configs") or {},
        state.get("param_shapes") or {},
        state.get("progress") or {},
        state.get("opt_param_scheduler") or {},
        tuple(files) if files is not None else None,
    )


def start_progress(point: Optional[ResumePoint], finetune: bool) -> Progress:
    """The checkpoint's progress; a checkpoint saved before progress was stored consumed iteration x its
    batch size (no ramps then) and evaluated one fixed window (valid samples from 0)."""
    if point is None or finetune:
        return Progress()
    if point.progress:
        return Progress(**point.progress)
    batch = (point.configs.get("train") or {}).get("global_batch_size", 0)
    return Progress(consumed_train_samples=point.iteration * batch)


def is_import(point: ResumePoint) -> bool:
    """A Hugging Face import (tools/hf_checkpoint.py import, iteration 0): weights and configs, no schedule or
    optimizer state yet (its run builds its own param groups)."""
    return not point.lr_schedule and not point.configs.get("train")


def start_lr_schedule(
    current: LearningRateSchedule, point: Optional[ResumePoint], ckpt, train
) -> Tuple[LearningRateSchedule, float]:
    """The schedule the run follows and the samples it has advanced (Megatron's num_steps). A resume loads
    them with the optimizer, as Megatron does: --no-load-optim and --finetune start the schedule at 0."""
    if point is None or ckpt.no_load_optim or ckpt.finetune:
        return current, 0
    if is_import(point):
        return current, 0
    saved = point.lr_schedule or _schedule_of_old_checkpoint(point)
    schedule = resumed_schedule(
        current, saved, train.override_opt_param_scheduler, train.use_checkpoint_opt_param_scheduler
    )
    return schedule, saved["num_steps"]


def _schedule_of_old_checkpoint(point: ResumePoint) -> Dict[str, Any]:
    """A checkpoint saved before the schedule was recorded: the one its stored flags give, advanced by the
    samples it consumed (a skipped step advanced it then)."""
    stored = {
        n: v
        for n, v in (point.configs.get("train") or {}).items()
        if n in {f.name for f in dataclasses.fields(TrainConfig)}
    }
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    schedule = LearningRateSchedule.from_config(SimpleNamespace(**{**defaults, **stored}))
    return schedule.state(start_progress(point, False).consumed_train_samples)


def start_iteration(point: Optional[ResumePoint], train_iters: int, finetune: bool, skip_train: bool = False) -> int:
    """Where the run starts: the checkpoint's iteration (at --train-iters the run trains nothing and does the end
    of a run, as Megatron's relaunch does), a ConfigError beyond --train-iters unless --skip-train."""
    if point is None or finetune:
        return 0
    if point.iteration > train_iters and not skip_train:
        raise ConfigError(
            f"--train-iters={train_iters}: below the iteration of the checkpoint {point.path} "
            f"({point.iteration}); raise it to go on, or --finetune to start a new run from its weights"
        )
    return point.iteration


def _model_sections(cfg) -> List[str]:
    return [f.name for f in dataclasses.fields(cfg) if model_defining_fields(getattr(cfg, f.name))]


def model_differences(cfg, point: ResumePoint) -> List[str]:
    """'--flag: X in the checkpoint, Y now' for each model-defining flag whose values differ. Not compared: a
    field the checkpoint did not store (saved before it existed), and one left unset on either side for the code
    to derive (--ffn-hidden-size); where None is a setting (no shared expert, no window) it is compared."""
    out = []
    for section in _model_sections(cfg):
        current, saved = getattr(cfg, section), point.configs.get(section) or {}
        derived = derived_when_none_fields(current)
        for name in model_defining_fields(current):
            if name not in saved:
                continue
            old, new = saved[name], getattr(current, name)
            if name in derived and (old is None or new is None):
                continue
            if old != new:
                out.append(f"{flag_of(current, name)}: {_shown(old)} in the checkpoint, {_shown(new)} now")
    return out


# what decides which tokens each sample holds and their order, besides the model's flags
DATA_STREAM_FIELDS = {
    "data": ("data_path", "split", "mock_data", "default_corpus_max_files"),
    "model": ("seq_length",),
    "train": ("seed",),
}


def data_differences(cfg, point: ResumePoint) -> List[str]:
    """'--flag: X in the checkpoint, Y now' for each flag of the sample stream that differs from the checkpoint's
    (not compared: a field it did not store). Megatron resumes on such a change without a word: the run goes on at
    its consumed-sample count in the new stream. Compared as they act: the same files under another spelling of
    the path, or the same split in other numbers, are no change; the default corpus's size only without a
    --data-path."""
    out = []
    for section, names in DATA_STREAM_FIELDS.items():
        current, saved = getattr(cfg, section), point.configs.get(section) or {}
        for name in names:
            if name not in saved or name == "default_corpus_max_files" and not _on_default_corpus(saved, current):
                continue
            old, new = saved[name], getattr(current, name)
            same = {
                "data_path": lambda a, b: _blend(a) == _blend(b),
                "split": lambda a, b: _split_fractions(a) == _split_fractions(b),
            }.get(name, lambda a, b: a == b)
            if not same(old, new):
                out.append(f"{flag_of(current, name)}: {_words(old)} in the checkpoint, {_words(new)} now")
    return out


def _on_default_corpus(saved: Dict[str, Any], current) -> bool:
    return not (saved.get("data_path") or saved.get("mock_data") or current.data_path or current.mock_data)


def _blend(data_path) -> Optional[Tuple]:
    """--data-path as the data layer reads it (a string from an older checkpoint too): its prefixes as real paths,
    its weights normalised."""
    if not data_path:
        return None
    blend = parse_data_path(
        [word for part in ([data_path] if isinstance(data_path, str) else data_path) for word in part.split()]
    )
    return tuple(map(os.path.realpath, blend.prefixes)), _normalised(blend.weights)


def _split_fractions(split) -> Optional[Tuple[float, ...]]:
    """--split as DataConfig (and megatron-core) reads it: up to three weights, zeros after, normalised."""
    return _normalised(DataConfig(split=str(split)).split_weights)


def _normalised(weights) -> Optional[Tuple[float, ...]]:
    return tuple(round(w / sum(weights), 12) for w in weights) if weights else None


def _words(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else _shown(value)


def _shown(value) -> str:
    return "unset" if value is None else str(value)


def check_same_model(cfg, point: ResumePoint) -> None:
    differences = model_differences(cfg, point)
    if differences:
        raise CheckpointError(
            f"--load: {point.path} holds another model ({'; '.join(differences)}); give the "
            "checkpoint's values or --use-checkpoint-args"
        )


# what a Hugging Face config says about training (attention_dropout, router_aux_loss_coef), taken from an
# imported checkpoint by --use-checkpoint-args where the command line does not set it
IMPORTED_TRAINING_FIELDS = {"model": ("hidden_dropout", "attention_dropout"), "moe": ("aux_loss_coeff",)}
# what Megatron's load_args_from_checkpoint also takes from its own checkpoints (the sequence length, the
# dropouts), here where the command line does not set it
CHECKPOINT_TRAINING_FIELDS = {"model": ("seq_length", "hidden_dropout", "attention_dropout")}


def upcycling_point(point: ResumePoint, model: GPTConfig, moe: MoEConfig, report: Callable[[str], None]) -> ResumePoint:
    """The dense checkpoint seen as the MoE run's: its MoE section and layer pattern are the command line's,
    so --use-checkpoint-args and the same-model check apply to the rest. Errors name what cannot upcycle."""
    if (point.configs.get("moe") or {}).get("num_experts"):
        raise ConfigError(f"--moe-use-upcycling: {point.path} is already an MoE checkpoint (it needs a dense one)")
    report(
        f" --moe-use-upcycling: the experts start as the dense MLPs of {point.path} (iteration "
        f"{point.iteration}); starting at 0"
    )
    configs = dict(
        point.configs,
        moe=dataclasses.asdict(moe),
        model=dict(point.configs.get("model") or {}, moe_layer_freq=model.moe_layer_freq),
    )
    return dataclasses.replace(point, configs=configs)


def apply_hub_configs(cfg, hub_dir: str, configs: Dict[str, Dict[str, Any]], report: Callable[[str], None]):
    """--load-hf: `cfg` with the Hub folder's model (`configs`: moezero.hf.run_configs) as --use-checkpoint-args
    takes an imported checkpoint's."""
    point = ResumePoint(path=hub_dir, iteration=0, configs=configs, param_shapes={})
    return apply_checkpoint_args(cfg, point, report, source="--load-hf")


def apply_checkpoint_args(
    cfg, point: ResumePoint, report: Callable[[str], None], source: str = "--use-checkpoint-args"
):
    """--use-checkpoint-args: `cfg` with the checkpoint's model-defining flags (and its tokenizer files
    where the command line gives none; the training values Megatron takes too, or for a checkpoint from a Hugging
    Face import its config's, where the command line does not set them); reports the flags typed on the command
    line whose values it replaced."""
    changes, sections = [], {}
    imported = point.configs.get("hf") is not None
    given = set(getattr(cfg.checkpoint, "given_fields", ()))
    for section in _model_sections(cfg):
        current, saved = getattr(cfg, section), point.configs.get(section) or {}
        names = list(model_defining_fields(current))
        training = IMPORTED_TRAINING_FIELDS if imported else CHECKPOINT_TRAINING_FIELDS
        names += [n for n in training.get(section, ()) if f"{section}.{n}" not in given]
        values = {n: saved[n] for n in names if n in saved}
        if getattr(cfg.checkpoint, "use_tokenizer_model_from_checkpoint_args", True):
            values.update(
                {
                    n: saved[n]
                    for n in TOKENIZER_FILES
                    if saved.get(n) and hasattr(current, n) and getattr(current, n) is None
                }
            )
        # said for the flags typed only: an untyped one's value is the default, not the command line's
        changes += [
            f"{flag_of(current, n)} {v} (command line: {getattr(current, n)})"
            for n, v in values.items()
            if v != getattr(current, n) and f"{section}.{n}" in given
        ]
        sections[section] = dataclasses.replace(current, **values)
    if changes:
        report(f" {source}: {', '.join(changes)}")
    return dataclasses.replace(cfg, **sections)


def saved_vocabulary(point: ResumePoint) -> Optional[int]:
    """The rows of the checkpoint's word embedding: its padded vocabulary (None: not recorded)."""
    for name, shape in point.param_shapes.items():
        if plain_param_name(name) == "embedding.weight":
            return int(shape[0])
    return None


def adopted_vocabulary(
    point: ResumePoint, tokenizer_vocab: int, padded: int, tensor_parallel_size: int
) -> Optional[int]:
    """The checkpoint's padded vocabulary where this run's (`padded`: the tokenizer's padded for its tp) differs:
    Megatron pads to --make-vocab-size-divisible-by x tp, so a checkpoint saved at another tp has other rows, and
    its padded rows are logits of the softmax (the uninterrupted run's curve needs them). None: the run's own fits.
    Refused in one line where the rows hold fewer tokens than the tokenizer or do not split over this tp."""
    rows = saved_vocabulary(point)
    if rows is None or rows == padded:
        return None
    if rows < tokenizer_vocab:
        raise ConfigError(
            f"--load: {point.path} has a vocabulary of {rows} rows, fewer than the tokenizer's {tokenizer_vocab} "
            "tokens; give the checkpoint's tokenizer (or --use-checkpoint-args)"
        )
    if rows % tensor_parallel_size:
        saved = point.configs.get("parallel") or {}
        divisor = (point.configs.get("model") or {}).get("make_vocab_size_divisible_by", "?")
        raise ConfigError(
            f"--load: the padded vocabulary of {point.path} ({rows} rows: the tokenizer's {tokenizer_vocab} padded "
            f"to a multiple of --make-vocab-size-divisible-by {divisor} x tp "
            f"{saved.get('tensor_parallel_size', '?')}) does not split over --tensor-model-parallel-size "
            f"{tensor_parallel_size}; resume at a tp that divides {rows}"
        )
    return rows


def check_shapes(model: nn.Module, point: ResumePoint, elsewhere: Iterable[str] = ()) -> None:
    """The model's trainable params (global shapes: experts over all ranks, tensor-parallel slices whole) against
    the saved ones; `elsewhere`: the names of the params other pipeline stages hold (saved, not in this rank's
    model)."""
    saved = {plain_param_name(n): tuple(s) for n, s in point.param_shapes.items()}
    problems = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        shape = list(param.shape)
        shard = expert_shard_of(param)
        if shard is not None:
            shape[0] = shard.num_global_experts
        tensor_shard = tensor_shard_of(param)  # a tensor-parallel slice: its global tensor's
        if tensor_shard is not None:
            shape = list(tensor_shard.global_shape)
        old = saved.get(plain_param_name(name))
        if old is None:
            problems.append(f"{name} is not in it")
        elif old != tuple(shape):
            problems.append(f"{name} is {old} there, {tuple(shape)} here")
    mine = {plain_param_name(name) for name, _ in model.named_parameters()} | {plain_param_name(n) for n in elsewhere}
    problems += [f"{name} is in it, not in this model" for name in saved if name not in mine]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(
            f"--load: the weights of {point.path} do not fit this model ({'; '.join(problems[:3])}"
            f"{more}); {_hint(set(saved) - mine)}"
        )


def _hint(extra) -> str:
    if any(re.search(r"\.(q_down|kv_down)\.bias$", name) for name in extra):
        return (
            "its MLA down projections have biases: it was trained before moezero built multi-latent attention as "
            "megatron-core does (only the output projection biased); no flag builds that model now"
        )
    return "check the model flags, the tokenizer and --vocab-size"
