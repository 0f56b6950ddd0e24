"""One generation batch at a time in a background thread: how a colocated rank on the async
schedule decodes batch n + k while it trains batch n on the same device.

The engine holds its own copy of the weights, so training never changes them under a running
generation; new weights go in only after `join` (async_step.py). On CUDA the thread queues its
work on a stream of its own, so the device can interleave decode and training kernels. The two
streams meet at two points only: `start` (generation sees everything the caller's stream wrote
before it, such as the last weight update) and `join` (the caller's stream sees everything
generation wrote).

While the thread captures a CUDA graph (the engine does so for each new batch size), the caller
must not draw random numbers from the default CUDA generator: PyTorch ties that generator to every
capture, and a draw from another thread fails the capture ("Offset increment outside graph
capture"). The training step draws none.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class BackgroundGeneration(Generic[T]):
    """Runs one callable at a time in a daemon thread; `join` returns its result or raises its error."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, object] = {}

    @property
    def running(self) -> bool:
        """Whether a callable was started and not yet joined."""
        return self._thread is not None

    @property
    def finished(self) -> bool:
        """Whether the running callable has returned or raised (`join` would not wait)."""
        return self._thread is not None and not self._thread.is_alive()

    def start(self, work: Callable[[], T]) -> None:
        """Run `work()` in the background. Raises RuntimeError if the previous one was not joined."""
        if self._thread is not None:
            raise RuntimeError("a background generation is still running: join it first")
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._outcome = {}
        # A daemon thread: an error on the main thread ends the process without waiting for it.
        self._thread = threading.Thread(target=self._run, args=(work,), name="tandem-generation", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        on_stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        try:
            if self.stream is not None:
                # A new thread starts on device 0: Triton's launches and any default-device tensor
                # must go to this rank's GPU.
                torch.cuda.set_device(self.stream.device)
            with on_stream:
                self._outcome["value"] = work()
        except BaseException as error:  # handed to the joining thread, which raises it
            self._outcome["error"] = error

    def join(self) -> T:
        """Wait for the running callable; return its result, or raise what it raised."""
        thread, self._thread = self._thread, None
        if thread is None:
            raise RuntimeError("no background generation is running")
        thread.join()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]
