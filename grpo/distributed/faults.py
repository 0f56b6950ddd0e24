"""What a long job needs to survive: a graceful stop on SIGTERM / SIGINT, collective waits that
report whom they waited on, and start-up checks that fail before any heavy work."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist


class StartupError(RuntimeError):
    """The job cannot start here (output folder, disk space); the message says what to change."""


class CollectiveTimeout(RuntimeError):
    """A collective or transfer waited longer than parallelism.collective_timeout_s."""


class PeerLost(RuntimeError):
    """A collective or transfer lost its connection: another rank of the job died."""


# How gloo and NCCL word a peer that went away mid-transfer.
_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited")


def is_connection_lost(error: BaseException) -> bool:
    text = str(error).lower()
    return any(phrase in text for phrase in _CONNECTION_LOST)


def peer_lost(who: str, what: str) -> PeerLost:
    """The one line for a rank whose peers vanished while it waited for `what`."""
    return PeerLost(
        f"{who} lost its connection while waiting for {what}: they stopped answering (a rank of the job died; "
        "its own error, if it printed one, is above); run the same command to resume from the last checkpoint"
    )


class GracefulStop:
    """Turns SIGTERM / SIGINT into a request to stop at the next step boundary.

    The loop agrees on the request over all ranks, saves a checkpoint and exits 0. A second
    SIGINT (an impatient Ctrl-C) stops at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_number = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        for number in self.SIGNALS:
            self._previous[number] = signal.signal(number, self._handle)
            # Restart interrupted system calls: a signal must not cut a socket read of gloo or NCCL
            # in half (Python's handlers interrupt them by default).
            signal.siginterrupt(number, False)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        if number == signal.SIGINT and self.signal_number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = number

    @staticmethod
    def name(number: int) -> str:
        return signal.Signals(number).name


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


@contextmanager
def waiting_for(who: str, what: str, timeout_s: float) -> Iterator[None]:
    """Turn a collective's timeout inside the block into a CollectiveTimeout naming this rank (`who`,
    e.g. "generator rank 0") and what it waited for (`what`, e.g. "episodes from trainer ranks [1]")."""
    try:
        yield
    except (RuntimeError, dist.DistError) as error:
        if is_connection_lost(error):
            raise peer_lost(who, what) from None
        if not _is_timeout(error):
            raise
        raise CollectiveTimeout(
            f"{who} waited more than {timeout_s:g} s for {what} (parallelism.collective_timeout_s); "
            "that rank is stalled or gone"
        ) from None


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


def check_free_disk(path: str | Path, needed_bytes: int) -> None:
    """Raise StartupError when the disk holding `path` has less room than `needed_bytes`."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise StartupError(
            f"not enough free disk for one checkpoint in {str(path)!r}: it needs about "
            f"{needed_bytes / 1e9:.2f} GB and {free / 1e9:.2f} GB are free "
            "(free some space, or point job.output_dir at a larger disk)"
        )


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this job."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
