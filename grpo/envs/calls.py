"""An environment's calls, each bounded in time: a hung call fails its episode, not the run.

Calls run on a few daemon threads of the generator rank: environments mostly wait (on a tool's
subprocess, a sandbox, a remote service), so threads overlap them, and `async def` methods are
awaited on the calling thread's own event loop. A call still running after `timeout_s` counts as
failed and its thread is given up (a Python thread cannot be killed; a daemon thread does not keep
the process alive) and replaced, so the calls after it keep their workers.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (kind, value): ("ok", what the call returned), ("raised", the exception) or ("timeout", None)
CallOutcome = tuple[str, Any]


@dataclass
class _Call:
    fn: Callable[..., Any]
    args: tuple
    thread: threading.Thread | None = None
    started: float | None = None
    outcome: CallOutcome | None = None
    seconds: float = 0.0


class EnvCalls:
    """Runs an environment's calls on up to `workers` daemon threads, each call at most `timeout_s`."""

    def __init__(self, timeout_s: float, workers: int):
        self.timeout_s, self.workers = timeout_s, workers
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._threads: set[threading.Thread] = set()
        self._given_up: set[threading.Thread] = set()
        self._changed = threading.Condition()

    def run(self, fn: Callable[..., Any], arg_lists: list[tuple]) -> list[tuple[CallOutcome, float]]:
        """fn(*args) for each tuple of `arg_lists`, concurrently: (outcome, seconds) of each, in order."""
        calls = [_Call(_sync(fn), args) for args in arg_lists]
        with self._changed:
            self._top_up(len(calls))
        for call in calls:
            self._queue.put(call)
        with self._changed:
            while any(call.outcome is None for call in calls):
                now = time.monotonic()
                for call in calls:
                    if call.outcome is None and call.started is not None and now - call.started > self.timeout_s:
                        call.outcome, call.seconds = ("timeout", None), now - call.started
                        self._threads.discard(call.thread)
                        self._given_up.add(call.thread)
                        self._top_up(len(calls))
                self._changed.wait(timeout=min(0.05, self.timeout_s))
        return [(call.outcome, call.seconds) for call in calls]

    def _top_up(self, pending: int) -> None:
        """Start workers until min(workers, pending) run (the caller holds the lock)."""
        while len(self._threads) < min(self.workers, pending):
            thread = threading.Thread(target=self._work, daemon=True, name="tandem-env")
            self._threads.add(thread)
            thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while me not in self._given_up:
            call = self._queue.get()
            with self._changed:
                call.thread, call.started = me, time.monotonic()
            try:
                outcome: CallOutcome = ("ok", call.fn(*call.args))
            except Exception as error:
                outcome = ("raised", error)
            with self._changed:
                if call.outcome is None:
                    call.outcome, call.seconds = outcome, time.monotonic() - call.started
                self._changed.notify_all()
            # An idle worker must not keep its last call's arguments and result (an episode's
            # state) alive: an environment may free an episode's resources when its state goes.
            del call, outcome


def _sync(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, whose awaitable results (an `async def`'s) are run to completion on this thread's own event loop."""

    def call(*args: Any) -> Any:
        result = fn(*args)
        return asyncio.run(_wait(result)) if inspect.isawaitable(result) else result

    return call


async def _wait(awaitable: Any) -> Any:
    return await awaitable
