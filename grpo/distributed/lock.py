"""One run per output folder: an exclusive lock on `job.output_dir` for the life of the run.

The lock is `flock` on `<output_dir>/.tandem.lock`, which records the holder's host, pid and start
time. The kernel drops it when the holding process exits, however it exits (kill -9 included), so
no lock outlives its run; a lock file whose record is still filled but which nobody holds is what
a run that died leaves behind, and the next run takes it over with a warning. On a local disk and
on NFS (where Linux maps `flock` to POSIX locks) the lock holds across processes and nodes; on a
file system without cross-node locks (Lustre mounted without `-o flock`, for one) two runs on
different nodes are not detected.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from grpo.distributed.faults import StartupError

LOCK_NAME = ".tandem.lock"


def describe(holder: dict) -> str:
    """'pid 123 on host h, started 2026-12-01 09:00:00' from a lock record."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {started}"


def read_holder(output_dir: str | Path) -> dict:
    """The lock file's record (empty when there is none or it cannot be read)."""
    try:
        return json.loads((Path(output_dir) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def refusal(output_dir: str | Path) -> StartupError:
    """The error of a run that finds the folder taken, naming the holder."""
    return StartupError(
        f"job.output_dir = {str(output_dir)!r} is in use by another run ({describe(read_holder(output_dir))}); "
        "stop that run or give this one another job.output_dir"
    )


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
            raise refusal(self.output_dir) from None
        previous = read_holder(self.output_dir)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        if previous:
            return f"warning: {self.path} was left by a run that is gone ({describe(previous)}); taking it over"
        return None

    def release(self) -> None:
        """Clear the record and drop the lock (a clean exit leaves nothing to take over)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None
