"""Multi-turn episodes: the environment interface (base.py), the built-in environments, and how
`env.name` picks one (`make_environment`). The rollout that alternates model turns and
environment turns is grpo/rollout/conversation.py."""

from __future__ import annotations

from typing import Any

from grpo.envs.base import Environment, EnvReply
from grpo.envs.relay import DigitRelay
from grpo.envs.tools import Calculator
from grpo.errors import TandemError
from grpo.scoring.calls import import_callable

__all__ = ["BUILTIN_ENVIRONMENTS", "EnvReply", "Environment", "EnvironmentLoadError", "make_environment"]

# env.name -> how the built-in environment is made from the run's seed and tokenizer
BUILTIN_ENVIRONMENTS = {
    "digit_relay": lambda seed, tokenizer: DigitRelay(seed=seed),
    "calculator": lambda seed, tokenizer: Calculator(tokenizer, seed=seed),
}


class EnvironmentLoadError(TandemError, ValueError):
    """env.name does not give an environment; the message names the spec and why."""


def make_environment(name: str, seed: int, tokenizer: Any, max_turns: int = 0) -> Environment:
    """The environment `name` gives: a built-in (made with `seed` and the run's tokenizer), or
    "module:factory", a callable imported from sys.path (the launch directory included) and called
    with no arguments. max_turns > 0 lowers the environment's own cap on model turns."""
    if name in BUILTIN_ENVIRONMENTS:
        try:
            env = BUILTIN_ENVIRONMENTS[name](seed, tokenizer)
        except ValueError as error:
            raise EnvironmentLoadError(f"env.name = {name!r}: {error}") from None
    else:
        try:
            factory = import_callable(name)
        except ValueError as error:
            raise EnvironmentLoadError(f"env.name = {name!r}: {error}") from None
        env = factory()
    for attribute in ("name", "max_turns", "reset", "step"):
        if not hasattr(env, attribute):
            raise EnvironmentLoadError(
                f"env.name = {name!r} gave a {type(env).__name__} without `{attribute}` (see grpo/envs/base.py)"
            )
    if max_turns:
        env.max_turns = min(env.max_turns, max_turns)
    return env
