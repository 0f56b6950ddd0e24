"""Helpers for tests that need torch.distributed on CPU (gloo): a 1-rank group in the test process,
real multi-rank runs in forked processes whose results come back through files, and a
one-intra-op-thread scope for the test process."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server, so that each rank starts with them already loaded.
_PRELOAD = [
    "torch", "torch.distributed.tensor", "torch.distributed.fsdp", "model", "model.parallelize", "grpo.distributed.roles",
    "grpo.distributed.weight_sync", "grpo.rollout.transport", "grpo.train.trainer", "grpo.engine", "grpo.rollout.generate",
    __name__,
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread for the duration of the block. The tests' matrices are tiny:
    extra threads only add synchronisation cost (badly so on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    rank: int, world_size: int, port: int, out_dir: str, fn: Callable[[int, int], Any], collective_timeout_s: float
) -> None:
    # A rank stopped from outside (the run's deadline, or a failed peer) leaves its threads' stacks
    # for the parent's error: the one clue to a hang outside a collective, where no timeout fires.
    stacks = open(Path(out_dir) / f"rank{rank}.stacks", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGTERM, file=stacks, chain=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        result = fn(rank, world_size)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        if _broken:
            os._exit(0)  # skip the barrier and the group's teardown: both could wait on a dead peer
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _module_of(fn: Callable) -> str:
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    return fn.__module__


def run_ranks(
    fn: Callable[[int, int], Any],
    world_size: int,
    out_dir: str | Path,
    timeout_s: float = 90.0,
    collective_timeout_s: float | None = None,
) -> list[Any]:
    """Run fn(rank, world_size) on world_size gloo ranks; returns each rank's return value (through files).

    fn must be a module-level function or a functools.partial of one (it is pickled by reference into
    the ranks). Every collective of the default group times out after collective_timeout_s (default
    timeout_s / 2), so a rank mismatch fails instead of hanging, and the whole run is killed after
    timeout_s. On failure raises RuntimeError carrying the failing ranks' tracebacks.
    """
    out_dir = Path(out_dir)
    if collective_timeout_s is None:
        collective_timeout_s = timeout_s / 2
    # A fork server that has imported torch and the code under test once starts ranks in a fraction
    # of a second; fresh "spawn" interpreters each re-import torch (seconds apiece on 2 cores). The
    # preload list only counts when the server starts (the first run of the session).
    multiprocessing.set_forkserver_preload([*_PRELOAD, _module_of(fn)])
    context = mp.start_processes(
        _entry, args=(world_size, free_port(), str(out_dir), fn, collective_timeout_s),
        nprocs=world_size, join=False, start_method="forkserver",
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {timeout_s} s (hang?)")
    except Exception as exc:
        _stop(context.processes)
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("*.error")))
        errors += "".join(f"\n{p.stem}'s threads when it was stopped:\n{p.read_text()}"
                          for p in sorted(out_dir.glob("*.stacks")) if p.stat().st_size)
        raise RuntimeError(f"distributed run failed: {exc}\n{errors}") from exc
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _stop(processes: list) -> None:
    """SIGTERM first, so that each rank writes its stacks, then SIGKILL for any still alive after 2 s."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    give_up = time.monotonic() + 2.0
    for process in processes:
        process.join(timeout=max(0.0, give_up - time.monotonic()))
        if process.is_alive():
            process.kill()
