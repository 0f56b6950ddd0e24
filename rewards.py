"""Reward functions and their loading.

A reward function scores one episode: ``fn(prompt, completion, answer, metadata) -> float``.
``completion`` is the decoded model output with the EOS stripped; ``answer`` and ``metadata``
come from the prompt source. Functions run in worker processes, so they must be importable
module-level callables. Scorer workers import this module to run them, so it imports only the
standard library.
"""

import functools
import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable

RewardFn = Callable[[str, str, str, dict], float]


class RewardError(ValueError):
    pass


def digit_match(prompt: str, completion: str, answer: str, metadata: dict) -> float:
    """The built-in digit tasks' reward: positional agreement with the reference answer.

    Partial credit per position: the reward is the number of positions where completion and
    answer agree, divided by max(len(answer), len(completion)), so it lies in [0, 1] and an
    output that is too long or too short is penalised through the max(). An empty completion
    scores 0.

    Any policy that ignores the prompt's digits (even one that knows its length) scores at most
    0.1 in expectation on uniformly random digits: each position matches with probability 1/10.
    A mean reward clearly above 0.1 therefore means the policy reads the prompt.
    """
    matches = sum(c == a for c, a in zip(completion, answer))
    length = max(len(answer), len(completion))
    return matches / length if length else 0.0


REWARDS: dict[str, RewardFn] = {"digit_match": digit_match}


def load_reward(spec: str) -> RewardFn:
    """Resolve a built-in name (see ``REWARDS``) or a ``"module:function"`` spec.

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
    if not module_name or not attr:
        raise RewardError(f"reward function {spec!r}: expected 'module:function'")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        detail = str(e) if isinstance(e, ImportError) else f"{type(e).__name__}: {e}"
        raise RewardError(f"reward function {spec!r}: cannot import module {module_name!r} ({detail})") from e
    if not hasattr(module, attr):
        raise RewardError(f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: {attr!r} is not callable ({type(fn).__name__})")
    # Catch a wrong signature now rather than in the first training step.
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature; let them through
        return fn
    try:
        signature.bind("", "", "", {})
    except TypeError:
        raise RewardError(
            f"reward function {spec!r}: signature {signature} does not accept "
            "(prompt, completion, answer, metadata)"
        ) from None
    return fn


def reward_name(spec: str) -> str:
    """The name a spec's rewards are reported under: the function part of ``"module:function"``."""
    return spec.rpartition(":")[2]


_load_cached = functools.cache(load_reward)


def score_episodes(
    spec: str, start: int, prompts: list[str], completions: list[str], answers: list[str], metadata: list[dict]
) -> tuple[list[float], str | None]:
    """Score episodes ``start, start + 1, ...`` with one reward function.

    Returns ``(rewards, None)``, or ``([], message)`` on the first failure. Scorer workers run
    this; errors come back as one-line messages, not exceptions, because an arbitrary exception
    may not pickle and only here is the episode index known.
    """
    name = reward_name(spec)
    try:
        fn = _load_cached(spec)
    except RewardError as e:
        return [], str(e)
    rewards = []
    for i, (prompt, completion, answer, meta) in enumerate(zip(prompts, completions, answers, metadata)):
        where = f"episode {start + i} (prompt {_clip(repr(prompt), 60)}, completion {_clip(repr(completion), 60)})"
        try:
            value = fn(prompt, completion, answer, meta)
        except Exception as e:
            return [], f"reward function {name!r} raised {_clip(repr(e), 200)} on {where}"
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            return [], (
                f"reward function {name!r} returned {_clip(repr(value), 60)} ({type(value).__name__}) "
                f"on {where}; expected a finite number"
            )
        rewards.append(float(value))
    return rewards, None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
