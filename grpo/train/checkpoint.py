"""Resumable checkpoints (DCP) and HF exports of the policy.

A checkpoint is the folder <job.output_dir>/checkpoints/step_N:
  trainer/        the fp32 policy and its AdamW state as DTensor shards, written by
                  torch.distributed.checkpoint: a run resumes on any number of trainer ranks
  run_state.json  step, policy version, data position, LR-schedule position, the evaluations so
                  far and the count of consecutive bad steps
  rng/rank_R.pt   each rank's RNG states
It is written as .tmp-step_N and renamed when whole, so a folder named step_N is always complete.

Prompts are a function of (job.seed, step), so the step is the data position. Under the sync
schedule no generated episode is pending at a step boundary, where checkpoints are taken; under
the async schedule the batches generated ahead are, and each generator rank saves its own in
inflight/rank_R.pt (`load_inflight`). The KL reference model is the initial policy and is
rebuilt from it on resume, not saved.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from grpo.distributed.faults import restart_count
from grpo.errors import TandemError
from grpo.rollout.episode import EpisodeBatch
from grpo.train.trainer import Trainer
from model import ModelArgs
from model.hf import save_hf

CHECKPOINTS = "checkpoints"
RUN_STATE = "run_state.json"
_TRAINER = "trainer"
# the async schedule's batches generated ahead, one file per generator rank
_INFLIGHT = "inflight"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointMismatch(TandemError, ValueError):
    """A checkpoint that cannot be resumed here; the message names it and what does not fit."""


class _TrainerState(Stateful):
    """The trainer's sharded model and optimizer state in DCP's terms (FQN keys, DTensor values)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        model, optimizer = get_state_dict(self.trainer.model, self.trainer.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.trainer.model,
            self.trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def _is_complete(path: Path) -> bool:
    return (path / RUN_STATE).is_file() and (path / _TRAINER / ".metadata").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """The whole checkpoints under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and _is_complete(p)]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def incomplete_checkpoints(root: Path) -> list[Path]:
    """Folders a save left behind when the job died while writing them."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and (p.name.startswith(".tmp-") or (_STEP_DIR.fullmatch(p.name) and not _is_complete(p)))
    )


def find_resume(output_dir: str | Path, setting: str, announce: bool) -> Path | None:
    """The checkpoint this launch continues from, per checkpoint.resume, or None to start fresh.

    "auto": the latest complete checkpoint in the output folder. "none": start fresh, and refuse
    to overwrite an earlier run's checkpoints. A torchrun restart (--max-restarts) always acts as
    "auto": the attempt before it wrote the checkpoints. Anything else is a checkpoint folder.
    """
    root = checkpoint_root(output_dir)
    if setting not in ("auto", "none"):
        path = Path(setting)
        if not _is_complete(path):
            raise CheckpointMismatch(
                f"checkpoint.resume = {setting!r} is not a complete checkpoint "
                f"(expected {RUN_STATE} and {_TRAINER}/.metadata in it)"
            )
        return path
    if announce:
        for path in incomplete_checkpoints(root):
            print(f"warning: ignoring the half-written checkpoint {path}", file=sys.stderr, flush=True)
    found = complete_checkpoints(root)
    if setting == "none" and not restart_count():
        if found:
            raise CheckpointMismatch(
                f"job.output_dir = {str(output_dir)!r} already holds checkpoints (latest: {found[-1]}); "
                'continue that run with checkpoint.resume = "auto", or choose another job.output_dir'
            )
        return None
    return found[-1] if found else None


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the policy saved in checkpoint `path`, read from DCP's metadata only."""
    metadata = dcp.FileSystemReader(str(path / _TRAINER)).read_metadata()
    prefix = f"{_TRAINER}.model."
    return {
        key.removeprefix(prefix): tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(meta, "size")
    }


def check_matches(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointMismatch unless checkpoint `path` holds exactly these parameter shapes."""
    saved = saved_shapes(path)
    for name, shape in shapes.items():
        if name not in saved:
            raise CheckpointMismatch(f"checkpoint {path} was saved from another model: it has no parameter {name}")
        if saved[name] != shape:
            raise CheckpointMismatch(
                f"checkpoint {path} was saved from another model: {name} is {list(saved[name])} there "
                f"and {list(shape)} in this run's model"
            )
    extra = sorted(set(saved) - set(shapes))
    if extra:
        raise CheckpointMismatch(
            f"checkpoint {path} was saved from another model: it has {len(extra)} parameters this model lacks "
            f"(first: {extra[0]})"
        )


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _everyone() -> None:
    """A barrier over the whole launch on CPU tensors (gloo), whatever the device backend."""
    dist.all_reduce(torch.zeros(1), group=None)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    root: Path,
    step: int,
    trainer: Trainer | None,
    trainer_group: dist.ProcessGroup | None,
    run_state: dict,
    is_writer: bool,
    keep: int,
    inflight: dict[int, tuple[EpisodeBatch | None, float]] | None = None,
) -> Path:
    """Write checkpoint step_`step` under `root` and keep the newest `keep` (0 = all).
    inflight: this rank's generation batches not yet trained on (async schedule), by step.
    Collective over every rank of the launch; returns the checkpoint's folder."""
    final, tmp = root / f"step_{step}", root / f".tmp-step_{step}"
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _everyone()
    if trainer is not None:
        dcp.save({_TRAINER: _TrainerState(trainer)}, checkpoint_id=str(tmp / _TRAINER), process_group=trainer_group)
    torch.save(_rng_states(), tmp / "rng" / f"rank_{dist.get_rank()}.pt")
    if inflight is not None:
        batches = {step: (None if b is None else {f.name: getattr(b, f.name) for f in fields(b)}, seconds)
                   for step, (b, seconds) in inflight.items()}
        (tmp / _INFLIGHT).mkdir(exist_ok=True)  # by each generator rank: only async checkpoints have it
        torch.save(batches, tmp / _INFLIGHT / f"rank_{dist.get_rank()}.pt")
    _everyone()
    if is_writer:
        if trainer is not None:
            scheduler = trainer.scheduler
            run_state = {
                **run_state,
                "lr_scheduler": {"last_epoch": scheduler.last_epoch, "step_count": scheduler._step_count},
            }
        run_state = {**run_state, "world_size": dist.get_world_size()}
        _write_durably(tmp / RUN_STATE, json.dumps(run_state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for stale in incomplete_checkpoints(root):
            shutil.rmtree(stale, ignore_errors=True)
        complete = complete_checkpoints(root)
        for old in complete[: max(0, len(complete) - keep) if keep else 0]:
            shutil.rmtree(old, ignore_errors=True)
    _everyone()
    return final


def load_checkpoint(path: Path, trainer: Trainer | None, trainer_group: dist.ProcessGroup | None) -> dict:
    """Restore the trainer (model, optimizer, LR schedule) and this rank's RNG from checkpoint `path`;
    returns its run state. Collective over the trainer ranks; any trainer count may load any checkpoint."""
    run_state = json.loads((path / RUN_STATE).read_text(encoding="utf-8"))
    if trainer is not None:
        dcp.load({_TRAINER: _TrainerState(trainer)}, checkpoint_id=str(path / _TRAINER), process_group=trainer_group)
        scheduler = trainer.scheduler
        scheduler.last_epoch = run_state["lr_scheduler"]["last_epoch"]
        scheduler._step_count = run_state["lr_scheduler"]["step_count"]
        # get_last_lr() reports the LR of the last update; the optimizer already holds it.
        scheduler._last_lr = [group["lr"] for group in trainer.optimizer.param_groups]
    rng = path / "rng" / f"rank_{dist.get_rank()}.pt"
    # Ranks are only the same processes when the launch has the same shape.
    if run_state["world_size"] == dist.get_world_size() and rng.is_file():
        _set_rng_states(torch.load(rng, weights_only=False))
    return run_state


def load_inflight(path: Path) -> dict[int, tuple[EpisodeBatch | None, float]] | None:
    """This rank's in-flight generation batches saved in checkpoint `path` (None if it saved none).
    They are this rank's share of the prompts: the caller checks that the launch has the same shape."""
    file = path / _INFLIGHT / f"rank_{dist.get_rank()}.pt"
    if not file.is_file():
        return None
    saved = torch.load(file, weights_only=True)
    return {step: (None if b is None else EpisodeBatch(**b), seconds) for step, (b, seconds) in saved.items()}


def checkpoint_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """About how many bytes one checkpoint of a model with these parameter shapes takes: fp32
    weights plus AdamW's two fp32 moments."""
    return sum(math.prod(shape) for shape in shapes.values()) * 4 * 3


def export_hf(
    trainer: Trainer, args: ModelArgs, tokenizer_save: Callable[[Path], None] | None, path: Path, is_writer: bool
) -> None:
    """Write the fp32 policy as an HF folder (safetensors, config.json and, when given, the tokenizer
    files via `tokenizer_save(folder)`). Collective over the trainer ranks; written whole, then renamed."""
    weights = ((name, tensor) for name, _, tensor in trainer.full_weights(torch.float32))
    if not is_writer:
        for _ in weights:
            pass
        return
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(args, weights, tmp)
    if tokenizer_save is not None:
        tokenizer_save(tmp)
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
