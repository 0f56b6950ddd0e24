"""Python's cyclic garbage collector during a run: how long it pauses the process, and keeping the
objects that live as long as the run (model, optimizer, compiled graphs) out of its passes.

A full pass walks every tracked object; after the first step a rank holds millions of them (compiled
graphs, guards, tokenizer tables), so one oldest-generation pass costs a few hundred milliseconds of
a step that lasts about two seconds on one H200 (bench/RESULTS.md, "the garbage collector").
"""

from __future__ import annotations

import gc
import time
from types import TracebackType


class CollectorPauses:
    """Within the block, counts the time the cyclic collector holds the process (`lap`), and
    freezes the long-lived objects on request (`freeze_long_lived`). Leaving the block gives the
    frozen objects back to the collector, so that the interpreter's shutdown frees them: extension
    modules report objects still alive at exit as leaks."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._pass_start: float | None = None
        self._froze = False

    def _on_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._pass_start = time.perf_counter()
        elif self._pass_start is not None:
            self._seconds += time.perf_counter() - self._pass_start
            self._pass_start = None

    def lap(self) -> float:
        """Seconds of collector passes since the block began or the last lap."""
        seconds, self._seconds = self._seconds, 0.0
        return seconds

    def freeze_long_lived(self) -> None:
        """Collect what is garbage now, then move every surviving object to the permanent
        generation, which later passes skip. Call it once the long-lived objects exist."""
        gc.collect()
        gc.freeze()
        self._froze = True

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._on_pass)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        gc.callbacks.remove(self._on_pass)
        if self._froze:
            gc.unfreeze()
