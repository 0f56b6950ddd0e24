"""A pool of spawned reward worker processes, each with a pipe of its own.

Not `multiprocessing.Pool`: its workers share one task queue behind one lock, so a worker that dies
while it waits for work (Slurm signals every process of a job step; a hung call has to be killed)
can leave that lock taken, and the pool can then neither hand out work nor shut down. Here a
worker shares nothing with the others: one is killed (SIGKILL) without risk to the rest, workers
ignore SIGTERM and SIGINT (the rank finishes its step, saves and closes the pool), and a worker
that dies on its own is seen at once, as the end of its pipe.

This module imports nothing heavy: a spawned worker imports it, and must not bring torch along.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.distributed import host
from grpo.errors import TandemError

_PR_SET_PDEATHSIG = 1
_READY = "ready"
START_TIMEOUT_S = 300.0  # a worker's start-up: spawn, imports, the reward module, its `prepare`


# math_accuracy's 512 episodes on 16-core GPU hosts: 520 ms with 1 worker and 91 ms with 8 on an
# H200's; 85 ms with 8 and 49 ms with 15 on an H100's (bench/RESULTS.md).
MAX_AUTO_WORKERS_BESIDE_ENGINE = 8
MAX_AUTO_WORKERS = 16


def auto_pool_size(cores: int | None = None, local_ranks: int | None = None, engine_beside: bool = False) -> int:
    """The reward pool size `rewards.num_workers = -1` stands for, from this rank's share of the
    host's cores (by default the cores this process may run on over torchrun's LOCAL_WORLD_SIZE).

    A rank that only waits while its pool scores leaves the pool all of its share but one core (its
    own dispatching thread): 1 to MAX_AUTO_WORKERS. Where this rank's engine generates while the
    pool scores (`engine_beside`: scoring during generation, or colocated ranks on the async
    schedule), the engine's host work keeps half: 1 to MAX_AUTO_WORKERS_BESIDE_ENGINE."""
    if cores is None:
        cores = len(host.usable_cores())
    if local_ranks is None:
        local_ranks = host.local_ranks()[1]
    share = cores // max(local_ranks, 1)
    if engine_beside:
        return max(1, min(MAX_AUTO_WORKERS_BESIDE_ENGINE, share // 2))
    return max(1, min(MAX_AUTO_WORKERS, share - 1))


class PoolError(TandemError, RuntimeError):
    """A worker died or hung before it could take work."""


@dataclass
class Outcome:
    """What became of one task: `value` when `status == "ok"`, else `detail` says what happened
    ("raised": the task's exception; "timeout": killed at its deadline or never started before it;
    "died": the worker ended without answering)."""

    status: str
    value: Any = None
    detail: str = ""


class WorkerPool:
    """`size` spawned worker processes that run `fn(*args)` tasks, one at a time each."""

    def __init__(self, size: int, prepare: Callable[[], None] | None = None):
        """prepare: run once in each worker as it starts, before it reports ready (a picklable
        module-level callable, or a functools.partial of one)."""
        context = multiprocessing.get_context("spawn")  # forking a process with CUDA state is unsafe
        self._procs, self._conns = [], []
        for _ in range(size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_serve, args=(theirs, os.getpid(), prepare), name="reward-worker")
            proc.start()
            theirs.close()  # so that the worker's death reads as the end of `ours`
            self._procs.append(proc)
            self._conns.append(ours)
        self._ready = False
        # Also at interpreter exit, ahead of multiprocessing's join of its children: a worker that
        # ignores SIGTERM would otherwise be waited for until it ends, which it never does.
        self._finalizer = multiprocessing.util.Finalize(self, _stop, (self._procs, self._conns), exitpriority=10)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every worker has started (its start-up must not count against a task's
        timeout); raises PoolError naming a worker that died or did not start in time."""
        if self._ready:
            return
        deadline = time.monotonic() + timeout_s
        for proc, conn in zip(self._procs, self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise PoolError(f"reward worker (pid {proc.pid}) did not start within {timeout_s:.0f} s")
            try:
                message = conn.recv()
            except EOFError:
                raise PoolError(f"reward worker (pid {proc.pid}) died while starting ({_exit_status(proc)})") from None
            if message != _READY:
                raise PoolError(f"reward worker (pid {proc.pid}) failed to start: {message}")
        self._ready = True

    def run(
        self, fn: Callable, arg_lists: list[tuple], timeout_s: float, on_timeout: Callable[[int], bool]
    ) -> list[Outcome]:
        """Run fn(*args) for each of `arg_lists` on the idle workers, in order, and return their
        outcomes in the same order.

        Each task has `timeout_s` from its start; a worker whose task runs past that is killed.
        `on_timeout(i)` is then called for task i: False ends the run at once (the tasks not yet
        done count as timed out), True goes on with one more `timeout_s` shared by everything left.
        A pool that lost a worker has fewer to run on; `healthy` tells whether it did.
        """
        self.wait_ready(START_TIMEOUT_S)
        outcomes: list[Outcome | None] = [None] * len(arg_lists)
        running: dict[int, tuple[int, float]] = {}  # worker -> (task, started at)
        next_task, shared_deadline = 0, None
        while any(outcome is None for outcome in outcomes):
            idle = [w for w in range(len(self._procs)) if w not in running and self._procs[w].is_alive()]
            open_for_work = shared_deadline is None or time.monotonic() < shared_deadline
            while idle and next_task < len(arg_lists) and open_for_work:
                worker = idle.pop(0)
                self._conns[worker].send((fn, arg_lists[next_task]))
                running[worker] = (next_task, time.monotonic())
                next_task += 1
            now = time.monotonic()
            past_deadline = shared_deadline is not None and now >= shared_deadline
            if not running or past_deadline:
                # Nothing can run the rest: the shared deadline passed, or no worker is left.
                for worker in list(running):
                    self._kill(worker)
                    running.pop(worker)
                left = Outcome("timeout") if past_deadline else Outcome("died", detail="no live reward worker left")
                outcomes = [left if outcome is None else outcome for outcome in outcomes]
                break
            deadlines = {w: start + timeout_s for w, (_, start) in running.items()}
            if shared_deadline is not None:
                deadlines = {w: min(d, shared_deadline) for w, d in deadlines.items()}
            wait = max(0.0, min(deadlines.values()) - now)
            ready = multiprocessing.connection.wait([self._conns[w] for w in running], timeout=wait)
            for worker in list(running):
                task, _ = running[worker]
                if self._conns[worker] in ready:
                    running.pop(worker)
                    outcomes[task] = self._receive(worker)
                elif time.monotonic() >= deadlines[worker]:
                    running.pop(worker)
                    self._kill(worker)
                    outcomes[task] = Outcome("timeout")
                    if not on_timeout(task):
                        shared_deadline = time.monotonic()
                    elif shared_deadline is None:
                        shared_deadline = time.monotonic() + timeout_s
        return outcomes  # type: ignore[return-value]

    @property
    def healthy(self) -> bool:
        """Whether every worker is still alive (none killed at a timeout, none died)."""
        return all(proc.is_alive() for proc in self._procs)

    def close(self) -> None:
        """Stop every worker: idle ones exit on the end-of-work message, the rest are killed."""
        self._finalizer()

    def _receive(self, worker: int) -> Outcome:
        try:
            ok, payload = self._conns[worker].recv()
        except (EOFError, OSError):
            self._procs[worker].join(timeout=5)
            proc = self._procs[worker]
            return Outcome("died", detail=f"the worker (pid {proc.pid}) died ({_exit_status(proc)})")
        return Outcome("ok", value=payload) if ok else Outcome("raised", detail=payload)

    def _kill(self, worker: int) -> None:
        self._procs[worker].kill()
        self._procs[worker].join(timeout=5)


def _stop(procs: list, conns: list) -> None:
    for proc, conn in zip(procs, conns):
        try:
            conn.send(None)
        except OSError:  # the worker is gone already
            pass
    deadline = time.monotonic() + 2.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():  # busy with a task (an interrupted run)
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()


def _exit_status(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _serve(conn, parent_pid: int, prepare: Callable[[], None] | None = None) -> None:
    """A worker's life: `prepare()`, then run tasks from `conn` until the end-of-work message or the
    pipe's end.

    SIGINT and SIGTERM are ignored: Ctrl-C and Slurm's SIGTERM are for the rank, which finishes its
    step (this worker's running call included), saves and closes the pool. On Linux the worker dies
    with its rank: a rank killed outright (kill -9, the OOM killer) must not leave a hung reward
    call running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent may have died before the request above took effect.
        if os.getppid() != parent_pid:
            os._exit(1)
    if prepare is not None:
        prepare()
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        except Exception as e:  # a task that cannot be unpickled here (its module does not import)
            conn.send((False, f"{type(e).__name__}: {e}"))
            continue
        if task is None:
            return
        fn, args = task
        try:
            reply = (True, fn(*args))
        except Exception as e:
            reply = (False, f"{type(e).__name__}: {e}")
        conn.send(reply)
