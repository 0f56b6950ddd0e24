"""This process's place on its host: the CPU cores it may run on and torchrun's local ranks.

Imports nothing heavy: spawned reward workers import grpo/scoring/pool.py, which reads it.
"""

from __future__ import annotations

import os


def usable_cores() -> list[int]:
    """The CPU ids this process may run on (its affinity; every core where the OS keeps none)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def local_ranks() -> tuple[int, int]:
    """(torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE): this rank among the launch's ranks on this host;
    (0, 1) outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
