"""Start-up of a reward pool worker, kept in a module of its own that imports nothing heavy (a
spawned worker imports its initializer's module, and this one must not bring torch along)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def start_worker(parent_pid: int) -> None:
    """Ignore Ctrl-C (the parent rank handles it: it finishes the step, saves, closes the pool) and,
    on Linux, die with the parent: a rank that is killed outright (kill -9, OOM killer) must not
    leave a worker running a hung reward call. SIGTERM stays fatal: it is how the pool stops a hung
    worker.

    The worker also leaves the rank's process group: torchrun (and Slurm) stop a rank by signalling
    its whole group, and a worker killed while it holds the pool's task-queue lock would leave the
    rank's own Pool.terminate() waiting for that lock forever, so the rank could never save and exit.
    The rank terminates its workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setsid()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent may have died before the request above took effect.
        if os.getppid() != parent_pid:
            os._exit(1)
