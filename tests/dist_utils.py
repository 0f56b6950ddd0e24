"""Helpers for tests that need torch.distributed on CPU (gloo): a 1-rank group in the test process,
and real multi-rank runs in spawned processes whose results come back through files."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def single_process_group() -> Iterator[None]:
    """A 1-rank gloo default group for the duration of the block (for code that needs a DeviceMesh)."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_broken = False


def abandon_group() -> None:
    """Called by a rank function whose collectives failed (e.g. timed out): the group is unusable, so
    the rank saves its result and exits without the closing barrier."""
    global _broken
    _broken = True


def _entry(
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable[[int, int], Any], timeout_s: float
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world_size)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        if _broken:
            os._exit(0)  # skip the barrier and the group's teardown: both could wait on a dead peer
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_ranks(
    fn: Callable[[int, int], Any], world_size: int, out_dir: str | Path, timeout_s: float = 120.0
) -> list[Any]:
    """Run fn(rank, world_size) on world_size spawned gloo ranks; returns each rank's return value.

    fn must be a module-level function (it is pickled by reference into the children). timeout_s
    bounds every collective, so a rank mismatch fails instead of hanging. On failure raises
    RuntimeError carrying the ranks' tracebacks.
    """
    out_dir = Path(out_dir)
    try:
        mp.spawn(_entry, args=(world_size, free_port(), str(out_dir), fn, timeout_s), nprocs=world_size, join=True)
    except Exception as exc:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("*.error")))
        raise RuntimeError(f"distributed run failed: {exc}\n{errors}") from exc
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
