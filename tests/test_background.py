"""grpo/run/background.py: one generation at a time in a background thread (colocated async)."""

from __future__ import annotations

import threading

import pytest
import torch

from grpo.run.background import BackgroundGeneration


def test_work_runs_beside_the_caller_and_join_returns_its_result():
    background = BackgroundGeneration(torch.device("cpu"))
    released = threading.Event()

    def work() -> str:
        # Only the caller, which goes on after start(), can let this finish.
        assert released.wait(timeout=30), "the caller was blocked while the work ran"
        return threading.current_thread().name

    background.start(work)
    assert background.running and not background.finished
    released.set()
    while not background.finished:
        released.wait(0.01)
    assert background.join() == "tandem-generation"
    assert not background.running


def test_join_raises_what_the_work_raised_and_one_runs_at_a_time():
    background = BackgroundGeneration(torch.device("cpu"))
    gate = threading.Event()

    def fails() -> None:
        gate.wait(timeout=30)
        raise ValueError("out of slots")

    background.start(fails)
    with pytest.raises(RuntimeError, match="still running"):
        background.start(lambda: None)
    gate.set()
    with pytest.raises(ValueError, match="out of slots"):
        background.join()
    with pytest.raises(RuntimeError, match="no background generation is running"):
        background.join()
