"""Start-up of a reward pool worker, kept in a module of its own that imports nothing heavy (a
spawned worker imports its initializer's module, and this one must not bring torch along)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


_stopping = None  # this worker's pool's "the rank is terminating us" event, set in start_worker


def start_worker(parent_pid: int, stopping) -> None:
    """Ignore Ctrl-C (the parent rank handles it: it finishes the step, saves, closes the pool) and,
    on Linux, die with the parent: a rank that is killed outright (kill -9, OOM killer) must not
    leave a worker running a hung reward call.

    SIGTERM from outside is for the rank, not for its workers. An idle worker waits for its next
    task holding the pool's task-queue lock; killed there, it would leave that lock taken, and the
    pool could neither hand out another task nor terminate (the rank could never save and exit).
    torchrun signals a rank's process group, which the worker leaves (setsid), but Slurm signals
    every process of a job step. So an idle worker ignores SIGTERM unless its rank has set
    `stopping` (Scorer.close, just before Pool.terminate); a worker running a task (run_task) dies
    of it, as the pool's way to stop a hung reward call."""
    global _stopping
    _stopping = stopping
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _idle_sigterm)
    os.setsid()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent may have died before the request above took effect.
        if os.getppid() != parent_pid:
            os._exit(1)


def _idle_sigterm(number: int, frame) -> None:
    if _stopping is not None and _stopping.is_set():
        os._exit(128 + number)


def run_task(fn, *args):
    """fn(*args) in a pool worker, with SIGTERM fatal while it runs (see start_worker)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return fn(*args)
    finally:
        signal.signal(signal.SIGTERM, _idle_sigterm)
