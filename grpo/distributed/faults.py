"""What a long job needs to survive once it runs: a graceful stop on SIGTERM / SIGINT, collective
waits that report whom they waited on, the line for a rank whose peers died, the Python stacks
of a rank that crashes in native code, and an exit that cannot crash after the work is done (the
checks that refuse a run before it starts are in preflight.py)."""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import NoReturn

import torch.distributed as dist

from grpo.errors import TandemError


class CollectiveTimeout(TandemError, RuntimeError):
    """A collective or transfer waited longer than parallelism.collective_timeout_s."""


class PeerLost(TandemError, RuntimeError):
    """A collective or transfer lost its connection: another rank of the job died."""


# How gloo and NCCL word a peer that went away mid-transfer.
_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited")


def is_connection_lost(error: BaseException) -> bool:
    text = str(error).lower()
    return any(phrase in text for phrase in _CONNECTION_LOST)


def peer_lost(who: str, what: str) -> PeerLost:
    """The one line for a rank whose peers vanished while it waited for `what`."""
    return PeerLost(
        f"{who} lost its connection while waiting for {what}: they stopped answering (a rank of the job died "
        "without a word: killed, out of memory, or a crash in native code); run the same command to resume "
        "from the last checkpoint"
    )


class GracefulStop:
    """Turns SIGTERM / SIGINT into a request to stop at the next step boundary.

    The loop agrees on the request over all ranks, saves a checkpoint and exits 0. A second
    SIGINT (an impatient Ctrl-C) stops at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal_number = 0
        self.forced = False
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
            # Libraries may wrap the KeyboardInterrupt (DCP does): `forced` tells the caller why it stopped.
            self.forced = True
            raise KeyboardInterrupt
        first, self.signal_number = not self.signal_number, number
        # Recorded before the print: a second signal can run this handler again inside the print,
        # and must find the first one there.
        if first and os.environ.get("RANK", "0") == "0":
            # A step can run for minutes: without a word the wait looks like a hang.
            print(f"{self.name(number)}: stopping when this step ends, after a checkpoint (Ctrl-C again stops at once)",
                  file=sys.stderr, flush=True)

    @staticmethod
    def name(number: int) -> str:
        return signal.Signals(number).name


def show_stacks_on_crash() -> None:
    """On a crash in native code (SIGSEGV, SIGABRT, SIGFPE, SIGBUS, SIGILL), print every thread's
    Python stack to stderr before the process dies. Left as it is where something already did so
    (PYTHONFAULTHANDLER, pytest)."""
    # Otherwise such a rank dies without a word, and torchrun's summary says only "Signal 6".
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def end_process(code: int) -> NoReturn:
    """End this rank's process with exit status `code` once its work is done and written: the exit
    handlers run (atexit, weakref.finalize), the standard streams are flushed, and the interpreter's
    teardown of its modules and threads is skipped.

    Why skip it: a C++ thread of a process group (gloo's workers) can hold the last reference to a
    tensor that Python made, for a moment after the collective that used it has finished. If that
    moment falls inside the interpreter's teardown, taking the GIL to free the tensor ends the thread
    inside a destructor, and the C++ runtime aborts the process ("terminate called without an
    active exception", SIGABRT). That turned a finished, saved run into a failed one, once in
    several hundred CPU runs. Without the teardown there is no such moment. (Python's
    multiprocessing ends its child processes the same way, which is why the test suite's forked
    ranks never met it.)"""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):  # a closed pipe has nothing left to lose
            stream.flush()
    os._exit(code)


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


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this job."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
