"""Start-up checks: a run that cannot work here stops before it builds or loads any model, with one
line (a StartupError, or CheckpointMismatch) that says what to change.

In the order a launch runs them (`train_grpo.run`, then `Run.__init__` once the model's shapes
are known):

    check_output_dir         this rank can create files in job.output_dir
    take_output_lock         no other run uses job.output_dir (the lock below)
    check_shared_output_dir  every rank sees the same folder (after the lock: a refused run must
                             not write into a folder another run owns)
    check_checkpoints        the checkpoint to resume holds this model, and what the run will still
                             write fits on disk (`disk_needed`); run again on the checkpoint a
                             resume falls back to, when the newest one does not load

One run per output folder: the first trainer rank holds `flock` on `<output_dir>/.tandem.lock`
for the life of the run; the file records the holder's host, pid and start time. The kernel drops
the lock when the holding process exits, however it exits (kill -9 included), so no lock outlives
its run; a lock file whose record is still filled but which nobody holds is what a run that died
leaves behind, and the next run takes it over with a warning. On a local disk and on NFS (where
Linux maps `flock` to POSIX locks) the lock holds across processes and nodes; on a file system
without cross-node locks (Lustre mounted without `-o flock`, for one) two runs on different nodes
are not detected.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

import torch.distributed as dist

from grpo.config import Config
from grpo.distributed.collectives import all_reduce
from grpo.errors import TandemError
from grpo.train.checkpoint import checkpoint_bytes
from grpo.train.checkpoint_folders import check_matches, checkpoint_root, complete_checkpoints, saved_step, step_of
from grpo.train.export import export_bytes
from grpo.train.save_errors import describe_bytes

LOCK_NAME = ".tandem.lock"


class StartupError(TandemError, RuntimeError):
    """The job cannot start here (output folder, disk space); the message says what to change."""


def check_output_dir(path: str | Path, rank: int) -> None:
    """Raise StartupError unless this rank can create files in `path` (created if missing)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise StartupError(f"job.output_dir = {str(path)!r} is a file, not a folder")
    probe = path / f".write-check-rank{rank}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise StartupError(f"job.output_dir = {str(path)!r} is not writable: {error.strerror or error}") from None


def check_shared_output_dir(path: str | Path, rank: int, leader: int) -> None:
    """Raise StartupError on every rank unless all ranks see one and the same `path`: the leader
    writes a fresh token there and each rank reads it back (a multi-node run without a shared file
    system would otherwise write divergent checkpoints). Collective over the launch."""
    marker = Path(path) / ".launch-check"
    token = [uuid.uuid4().hex if rank == leader else ""]
    dist.broadcast_object_list(token, src=leader)
    if rank == leader:
        marker.write_text(token[0])
    dist.barrier()
    try:
        sees = marker.read_text() == token[0]
    except OSError:
        sees = False
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, (sees, socket.gethostname()))
    if rank == leader:
        marker.unlink()
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise StartupError(
            f"job.output_dir = {str(path)!r} is not one folder for every rank: {', '.join(blind)} cannot see "
            f"what rank {leader} wrote there; a multi-node run needs job.output_dir on a file system every node mounts"
        )


def check_free_disk(path: str | Path, needed_bytes: int, what: str = "one checkpoint") -> None:
    """Raise StartupError when the disk holding `path` has less room than `needed_bytes` (for `what`)."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise StartupError(
            f"not enough free disk for {what} in {str(path)!r}: it needs about "
            f"{describe_bytes(needed_bytes)} and {describe_bytes(free)} are free "
            "(free some space, or point job.output_dir at a larger disk)"
        )


def check_checkpoints(
    cfg: Config, shapes: dict[str, tuple[int, ...]], resume: Path | None, trained: dict[str, tuple[int, ...]] | None = None
) -> None:
    """Given the model's parameter shapes and those of what trains (default: all; with LoRA the
    adapters, which are all a checkpoint holds), before any model is built (and for each checkpoint a
    resume falls back to): raise CheckpointMismatch unless checkpoint `resume` (when there is one)
    holds exactly the trained shapes, and StartupError unless the disk under job.output_dir has room
    for what the run will still write from there (`disk_needed`)."""
    trained = shapes if trained is None else trained
    if resume is not None:
        check_matches(resume, trained)
    start = saved_step(resume) if resume is not None else 0
    root = checkpoint_root(cfg.job.output_dir)
    on_disk = sum(step_of(path) <= start for path in complete_checkpoints(root))
    needed, what = disk_needed(cfg, checkpoint_bytes(trained), export_bytes(shapes), start, on_disk)
    check_free_disk(cfg.job.output_dir, needed, what)


def disk_needed(cfg: Config, checkpoint_size: int, export_size: int, start_step: int, on_disk: int) -> tuple[int, str]:
    """(bytes, what they are in words) that a run continuing after `start_step`, with `on_disk` of
    its checkpoints already there, adds to the disk at its fullest. Each save is whole before the
    oldest checkpoint beyond checkpoint.keep is deleted, so up to keep + 1 are there at once (keep
    = 0 keeps every one the run writes: every checkpoint.every steps and at the last step). HF
    exports are never deleted: every one due counts (every checkpoint.export_hf_every steps and at
    the last step). A stop or divergence saves one checkpoint early and ends the run before any
    later save, the last step's among them, so the count covers it too."""
    steps, keep = cfg.training.steps, cfg.checkpoint.keep
    saves = _due(start_step, steps, cfg.checkpoint.every)
    checkpoints = saves if keep == 0 or saves == 0 else max(1, min(on_disk + saves, keep + 1) - on_disk)
    exports = _due(start_step, steps, cfg.checkpoint.export_hf_every)
    why = "keeps them all" if keep == 0 else "keeps that many, and each new one is written before the oldest is deleted"
    what = (
        f"{_count(checkpoints, 'more checkpoint')} of about {describe_bytes(checkpoint_size)} (checkpoint.keep = "
        f"{keep} {why}) and {_count(exports, 'HF export')} of about {describe_bytes(export_size)}"
    )
    return checkpoints * checkpoint_size + exports * export_size, what


def _due(start: int, end: int, every: int) -> int:
    """How many of the steps start + 1 .. end a cadence of `every` steps (0 = none) or the last step falls on."""
    if end <= start:
        return 0
    periodic = end // every - start // every if every else 0
    return periodic + (0 if every and end % every == 0 else 1)


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}{'' if number == 1 else 's'}"


def take_output_lock(output_dir: str | Path, is_leader: bool) -> OutputLock | None:
    """The leader (first trainer rank) locks job.output_dir; every rank learns whether it could, and
    each raises the same StartupError naming the holder if not. Collective over the launch.
    Returns the leader's lock (None on the other ranks), to be released when the run ends."""
    lock, refused = (OutputLock(output_dir) if is_leader else None), 0.0
    if lock is not None:
        try:
            warning = lock.acquire()
        except StartupError:
            refused = 1.0
        else:
            if warning:
                print(warning, file=sys.stderr, flush=True)
    if all_reduce({"refused": refused}, None, dist.ReduceOp.MAX)["refused"]:
        raise _refusal(output_dir)
    return lock


class OutputLock:
    """Held by the first trainer rank from start-up to exit (see the module docstring)."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock, or raise StartupError naming its holder. Returns a warning when it takes
        over the record of a run that died."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refusal(self.output_dir) from None
        previous = _read_holder(self.output_dir)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if previous:
            return f"warning: {self.path} was left by a run that is gone ({_describe(previous)}); taking it over"
        return None

    def release(self) -> None:
        """Clear the record and drop the lock (a clean exit leaves nothing to take over)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None


def _describe(holder: dict) -> str:
    """'pid 123 on host h, started 2026-12-01 09:00:00' from a lock record."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {started}"


def _read_holder(output_dir: str | Path) -> dict:
    """The lock file's record (empty when there is none or it cannot be read)."""
    try:
        return json.loads((Path(output_dir) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _refusal(output_dir: str | Path) -> StartupError:
    """The error of a run that finds the folder taken, naming the holder."""
    return StartupError(
        f"job.output_dir = {str(output_dir)!r} is in use by another run ({_describe(_read_holder(output_dir))}); "
        "stop that run or give this one another job.output_dir"
    )
