"""One reward function over one chunk of episodes: load it from its spec, call it (per episode,
batched, or async), and turn every failure into a one-line message naming the function and the
episode.

Scorer workers run `score_chunk`, so this module imports only the standard library and rewards.py.
Errors come back as messages, not exceptions: an arbitrary exception may not pickle, and only here
is the episode index known.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rewards import REWARDS, RewardError, RewardFn

# (kind, value): ("ok", what the function returned) or ("raised", the exception)
CallOutcome = tuple[str, Any]
# (rewards, fatal_error, zeroed, first_error): see score_chunk
ChunkScore = tuple[list[float], str | None, int, str | None]


def load_reward(spec: str) -> RewardFn:
    """Resolve a built-in name (see ``rewards.REWARDS``) or a ``"module:function"`` spec.

    The module is imported from sys.path, with the current directory appended so that a reward
    file in the launch directory works under ``torchrun`` too.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep:
        if spec not in REWARDS:
            raise RewardError(
                f"unknown reward function {spec!r}; built-ins: {', '.join(sorted(REWARDS))} "
                "(or give 'module:function')"
            )
        return REWARDS[spec]
    try:
        fn = import_callable(spec)
    except ValueError as e:
        raise RewardError(f"reward function {spec!r}: {e}") from e.__cause__
    _check_signature(spec, fn)
    return fn


def import_callable(spec: str) -> Callable:
    """The callable a ``"module:name"`` spec names, imported from sys.path with the current
    directory appended (so that a file in the launch directory works under ``torchrun`` too).
    Raises ValueError saying what is wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError("expected 'module:function'")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        detail = str(e) if isinstance(e, ImportError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"cannot import module {module_name!r} ({detail})") from e
    if not hasattr(module, attr):
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"{attr!r} is not callable ({type(fn).__name__})")
    return fn


def _check_signature(spec: str, fn: Callable) -> None:
    """A wrong signature fails now rather than in the first training step."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature; let them through
        return
    try:
        signature.bind("", "", "", {})
    except TypeError:
        raise RewardError(
            f"reward function {spec!r}: signature {signature} does not accept "
            "(prompt, completion, answer, metadata)"
        ) from None


def reward_name(spec: str) -> str:
    """The name a spec's rewards are reported under: the function part of ``"module:function"``."""
    return spec.rpartition(":")[2]


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` was marked with ``@rewards.batched``."""
    return getattr(fn, "batched", False) is True


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with "..." when cut."""
    return text if len(text) <= limit else text[:limit] + "..."


_load_cached = functools.cache(load_reward)


def warm_up(specs: tuple[str, ...]) -> None:
    """Load each reward function and run its ``warm_up`` (rewards.py), if it has one: what a pool
    worker does once as it starts. A warm-up that fails leaves its function cold, not broken: the
    first real call meets the same problem and reports it, naming the episode."""
    for spec in specs:
        try:
            hook = getattr(_load_cached(spec), "warm_up", None)
            if callable(hook):
                hook()
        except Exception:
            continue


@dataclass
class _Chunk:
    """Episodes ``start, start + 1, ...`` as four columns: prompts, completions, answers, metadata."""

    name: str
    start: int
    columns: tuple[list[str], list[str], list[str], list[dict]]

    def __len__(self) -> int:
        return len(self.columns[0])

    def span(self) -> str:
        return f"episodes {self.start}-{self.start + len(self) - 1}"

    def where(self, i: int) -> str:
        prompts, completions = self.columns[:2]
        return f"episode {self.start + i} (prompt {clip(repr(prompts[i]), 60)}, completion {clip(repr(completions[i]), 60)})"

    def raised(self, error: BaseException, place: str) -> str:
        return f"reward function {self.name!r} raised {clip(repr(error), 200)} on {place}"


def score_chunk(
    spec: str,
    start: int,
    prompts: list[str],
    completions: list[str],
    answers: list[str],
    metadata: list[dict],
    on_error: str = "stop",
) -> ChunkScore:
    """Score a chunk of episodes (``start, start + 1, ...``) with one reward function.

    Returns ``(rewards, fatal_error, zeroed, first_error)``. ``fatal_error`` is a one-line message
    (with ``rewards == []``) for a failure that stops scoring: with ``on_error="stop"`` any failure;
    with either mode a spec that does not load or a batched function whose result has the wrong
    length or is not a sequence. With ``on_error="zero"``, an episode whose call raises or returns
    a non-number / non-finite value scores 0.0 instead; ``zeroed`` counts those episodes and
    ``first_error`` describes the first one (a batched call that raises zeroes the whole chunk).
    """
    try:
        fn = _load_cached(spec)
    except RewardError as e:
        return [], str(e), 0, None
    chunk = _Chunk(reward_name(spec), start, (prompts, completions, answers, metadata))
    if not (is_batched(fn) or _is_async(fn)):
        # Called lazily, episode by episode, so "stop" stops at the first failure.
        return _collect((_call_one(fn, chunk, i) for i in range(len(chunk))), chunk, on_error)
    try:
        outcomes = _call_batched(fn, chunk) if is_batched(fn) else _call_async(fn, chunk)
    except _BadResult as bad:
        return [], str(bad), 0, None
    except Exception as e:  # the call raised for the whole chunk (or asyncio.run inside a running loop)
        message = chunk.raised(e, chunk.span())
        return ([0.0] * len(chunk), None, len(chunk), message) if on_error == "zero" else ([], message, 0, None)
    return _collect(outcomes, chunk, on_error)


class _BadResult(Exception):
    """A batched function's result is not one number per episode: no episode can be scored."""


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _call_one(fn: RewardFn, chunk: _Chunk, i: int) -> CallOutcome:
    try:
        return "ok", fn(*(column[i] for column in chunk.columns))
    except Exception as e:
        return "raised", e


def _call_batched(fn: Callable, chunk: _Chunk) -> list[CallOutcome]:
    result = fn(*(list(c) for c in chunk.columns))
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__") or not hasattr(result, "__iter__"):
        raise _BadResult(
            f"batched reward function {chunk.name!r} returned {clip(repr(result), 60)} ({type(result).__name__}) "
            f"on {chunk.span()}; expected a list of {len(chunk)} numbers"
        )
    if len(result) != len(chunk):
        raise _BadResult(
            f"batched reward function {chunk.name!r} returned {len(result)} rewards for {len(chunk)} episodes "
            f"({chunk.span()}); expected one per episode"
        )
    return [("ok", value) for value in result]


def _call_async(fn: Callable, chunk: _Chunk) -> list[CallOutcome]:
    """The chunk's coroutines awaited concurrently; an episode's exception is its outcome."""
    results = asyncio.run(_gather(fn, chunk.columns))
    return [("raised", r) if isinstance(r, BaseException) else ("ok", r) for r in results]


def _collect(outcomes: Iterable[CallOutcome], chunk: _Chunk, on_error: str) -> ChunkScore:
    rewards, zeroed, first_error = [], 0, None
    for i, outcome in enumerate(outcomes):
        message = _problem(outcome, chunk, i)
        if message is None:
            rewards.append(float(outcome[1]))
            continue
        if on_error != "zero":
            return [], message, 0, None
        rewards.append(0.0)
        zeroed += 1
        first_error = first_error or message
    return rewards, None, zeroed, first_error


def _problem(outcome: CallOutcome, chunk: _Chunk, i: int) -> str | None:
    """None for a finite number, else the one-line message for episode i."""
    kind, value = outcome
    if kind == "raised":
        if isinstance(value, (KeyboardInterrupt, SystemExit)):
            raise value
        return chunk.raised(value, chunk.where(i))
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return (
            f"reward function {chunk.name!r} returned {clip(repr(value), 60)} ({type(value).__name__}) "
            f"on {chunk.where(i)}; expected a finite number"
        )
    return None


async def _await(awaitable):
    return await awaitable


async def _gather(fn: Callable, columns: tuple) -> list:
    return await asyncio.gather(*(fn(*episode) for episode in zip(*columns)), return_exceptions=True)
