"""Resumable checkpoints (DCP) of the training (HF exports of the policy: export.py).

A checkpoint is the folder <job.output_dir>/checkpoints/step_N:
  trainer/        the fp32 policy and its AdamW state as DTensor shards, written by
                  torch.distributed.checkpoint: a run resumes on any number of trainer ranks
                  (with LoRA only what trains: the adapters, never the frozen base)
  run_state.json  step, policy version, data position, LR-schedule position, the evaluations so
                  far and the count of consecutive bad steps
  rng/rank_R.pt   each rank's RNG states
  manifest.json   every other file's path and size, written last (durably) by the writer rank
It is written as .tmp-step_N and renamed when whole, so a folder named step_N is always complete.
A disk can still lose or cut its files later: before a resume, `damage` (checkpoint_folders.py)
checks them against the manifest (sizes only: on a Qwen3-0.6B-shaped checkpoint, 7.2 GB, a CRC32
pass took 6.7 s against 3.0 s for the load and 12.5 s for the save, on one CPU rank) and parses the
two small files that say what the checkpoint is. A newest checkpoint that fails that, or fails to
load on any rank, is renamed damaged-step_N (nothing is deleted) and the one before it is used
(`next_resume`, `set_aside_newer`, also there). A save that fails on any rank (out of space, say)
removes its temporary folder and leaves the older checkpoints as they were.

Prompts are a function of (job.seed, step), so the step is the data position. Under the sync
schedule no generated episode is pending at a step boundary, where checkpoints are taken; under
the async schedule the batches generated ahead are, and each generator rank saves its own in
inflight/rank_R.pt (`load_inflight`). The KL reference model is the initial policy and is
rebuilt from it on resume, not saved.
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from grpo.rollout.episode import EpisodeBatch
from grpo.train.checkpoint_folders import (
    MANIFEST,
    RUN_STATE,
    TRAINER_DIR,
    complete_checkpoints,
    incomplete_checkpoints,
    one_line,
)
from grpo.train.save_errors import CheckpointSaveError, describe_bytes, error_chain, no_space
from grpo.train.trainer import Trainer

# the async schedule's batches generated ahead, one file per generator rank
_INFLIGHT = "inflight"
T = TypeVar("T")


class _TrainerState(Stateful):
    """The trainer's sharded model and optimizer state in DCP's terms (FQN keys, DTensor values)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        # Frozen parameters (LoRA's base) are left out: they come from model.path, or from
        # job.seed for the built-in model, as they did when the run started.
        self.options = StateDictOptions(ignore_frozen_params=True, strict=trainer.lora is None)

    def state_dict(self) -> dict:
        model, optimizer = get_state_dict(self.trainer.model, self.trainer.optimizer, options=self.options)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(
            self.trainer.model,
            self.trainer.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self.options,
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


def _sync_folder(path: Path) -> None:
    """Make the names in folder `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Failure(NamedTuple):
    """How an action failed on one rank: `one_line` of its error, and whether the disk was full."""

    why: str
    out_of_space: bool


def on_every_rank(
    action: Callable[[], T], disk_full: Callable[[], bool] | None = None
) -> tuple[T | None, BaseException | None, dict[int, Failure]]:
    """Run `action` on this rank, then learn on which ranks of the launch it failed. Returns (its
    result here, None if it failed; the error it raised here, if any; rank -> Failure, for every
    rank it failed on). A failure is out of space when its error has ENOSPC (or EDQUOT) in its
    chain, or `disk_full()` says so right after it, while its partial files are still there (torch's
    writer reports a full disk without an errno). One all_gather over the launch: a barrier's place."""
    try:
        result, error = action(), None
    except (Exception, CheckpointException) as raised:  # DCP's CheckpointException is a BaseException
        if any(isinstance(cause, KeyboardInterrupt) for cause in error_chain(raised)):
            raise  # a second Ctrl-C, which DCP wraps: stop at once, and nothing is damaged
        result, error = None, raised
    mine = None
    if error is not None:
        mine = Failure(one_line(error), no_space(error) or (disk_full is not None and disk_full()))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return result, error, {rank: failure for rank, failure in enumerate(gathered) if failure is not None}


def save_checkpoint(
    root: Path,
    step: int,
    trainer: Trainer | None,
    trainer_group: dist.ProcessGroup | None,
    run_state: dict,
    is_writer: bool,
    keep: int,
    inflight: dict[int, tuple[EpisodeBatch | None, float]] | None = None,
    needed_bytes: int = 0,
) -> Path:
    """Write checkpoint step_`step` under `root` and keep the newest `keep` (0 = all).
    inflight: this rank's generation batches not yet trained on (async schedule), by step.
    needed_bytes: about how much one checkpoint takes; the writer first checks that the disk has
    that (or the newest checkpoint's size, when larger) free: the new checkpoint is whole before the
    oldest is deleted.
    Collective over every rank of the launch; returns the checkpoint's folder. When any part fails
    on any rank, every rank learns it, the writer removes .tmp-step_N, the older checkpoints stay as
    they were, and every rank raises CheckpointSaveError (out of space, or an I/O error), or the
    failing rank its own error when it is neither (a bug) and the others CheckpointSaveError."""
    final, tmp = root / f"step_{step}", root / f".tmp-step_{step}"
    if is_writer:
        needed_bytes = max(needed_bytes, _size_of_newest(root))
    stages = [
        lambda: _prepare(root, tmp, needed_bytes) if is_writer else None,
        lambda: _write_shards(tmp, trainer, trainer_group, inflight),
        lambda: _finish(root, tmp, final, trainer, run_state, keep) if is_writer else None,
    ]
    folder = root if root.exists() else root.parent
    for stage in stages:
        _, error, failed = on_every_rank(stage, lambda: shutil.disk_usage(folder).free < needed_bytes)
        if failed:
            _give_up(root, tmp, final, needed_bytes, is_writer, error, failed)
    return final


def _size_of_newest(root: Path) -> int:
    """Bytes of the newest complete checkpoint under `root` (0: none); the next one is as large."""
    complete = complete_checkpoints(root)
    return sum(p.stat().st_size for p in complete[-1].rglob("*") if p.is_file()) if complete else 0


def _prepare(root: Path, tmp: Path, needed_bytes: int) -> None:
    """The writer's start of a save: room for it on the disk, and an empty temporary folder."""
    root.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(root).free < needed_bytes:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root))
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "rng").mkdir(parents=True)


def _write_shards(
    tmp: Path, trainer: Trainer | None, trainer_group: dist.ProcessGroup | None,
    inflight: dict[int, tuple[EpisodeBatch | None, float]] | None,
) -> None:
    """What each rank saves: its trainer shards (DCP, collective over the trainer ranks), its RNG
    states and, on an async run's generator ranks, its batches in flight."""
    if trainer is not None:
        dcp.save({TRAINER_DIR: _TrainerState(trainer)}, checkpoint_id=str(tmp / TRAINER_DIR), process_group=trainer_group)
    torch.save(_rng_states(), tmp / "rng" / f"rank_{dist.get_rank()}.pt")
    if inflight is not None:
        batches = {step: (None if b is None else {f.name: getattr(b, f.name) for f in fields(b)}, seconds)
                   for step, (b, seconds) in inflight.items()}
        (tmp / _INFLIGHT).mkdir(exist_ok=True)  # by each generator rank: only async checkpoints have it
        torch.save(batches, tmp / _INFLIGHT / f"rank_{dist.get_rank()}.pt")


def _finish(root: Path, tmp: Path, final: Path, trainer: Trainer | None, run_state: dict, keep: int) -> None:
    """The writer's end of a save, once every rank's files are written: the run state, the
    manifest (last, durably), the rename to step_N, then pruning to the newest `keep`."""
    if trainer is not None:
        scheduler = trainer.scheduler
        run_state = {**run_state, "lr_scheduler": {"last_epoch": scheduler.last_epoch, "step_count": scheduler._step_count}}
    run_state = {**run_state, "world_size": dist.get_world_size()}
    _write_durably(tmp / RUN_STATE, json.dumps(run_state, indent=2))
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    sizes = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in files}
    _write_durably(tmp / MANIFEST, json.dumps({"files": sizes}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _sync_folder(root)
    for stale in incomplete_checkpoints(root):
        shutil.rmtree(stale, ignore_errors=True)
    complete = complete_checkpoints(root)
    for old in complete[: max(0, len(complete) - keep) if keep else 0]:
        shutil.rmtree(old, ignore_errors=True)


def _give_up(
    root: Path, tmp: Path, final: Path, needed_bytes: int, is_writer: bool, error: BaseException | None,
    failed: dict[int, Failure],
) -> None:
    """End a save that failed on the ranks in `failed`: the writer removes the temporary folder,
    then every rank raises (see `save_checkpoint`). Collective over the launch."""
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
    _everyone()
    free = shutil.disk_usage(root if root.exists() else root.parent).free
    if any(failure.out_of_space for failure in failed.values()):
        raise CheckpointSaveError(
            f"out of disk space saving checkpoint {final}: it needs about {describe_bytes(needed_bytes)} and "
            f"{describe_bytes(free)} are free; the older checkpoints in {root} are as they were (free some space "
            "or lower checkpoint.keep, then run the same command to resume)"
        ) from error
    if error is not None and not any(isinstance(cause, OSError) for cause in error_chain(error)):
        raise error
    rank, failure = next(iter(failed.items()))
    raise CheckpointSaveError(
        f"could not save checkpoint {final}: {failure.why} (rank {rank}); the older checkpoints in {root} are as they were"
    ) from error


def load_checkpoint(path: Path, trainer: Trainer | None, trainer_group: dist.ProcessGroup | None) -> dict:
    """Restore the trainer (model, optimizer, LR schedule) and this rank's RNG from checkpoint `path`;
    returns its run state. Collective over the trainer ranks; any trainer count may load any checkpoint."""
    run_state = json.loads((path / RUN_STATE).read_text(encoding="utf-8"))
    if trainer is not None:
        dcp.load({TRAINER_DIR: _TrainerState(trainer)}, checkpoint_id=str(path / TRAINER_DIR), process_group=trainer_group)
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


