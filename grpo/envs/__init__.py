"""Multi-turn episodes: the environment interface (base.py), the built-in environments, the
adapters to other libraries' environments (adapters/), and how `env.name` and `env.args` pick one
(`make_environment`). The rollout that alternates model turns and environment turns is
grpo/rollout/conversation.py."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grpo.envs.adapters import ADAPTERS
from grpo.envs.base import Environment, EnvReply
from grpo.envs.relay import DigitRelay
from grpo.envs.tools import Calculator
from grpo.errors import TandemError
from grpo.scoring.calls import import_callable

__all__ = ["BUILTIN_ENVIRONMENTS", "EnvReply", "Environment", "EnvironmentLoadError", "make_environment"]


def _without_args(make: Callable[[int, Any], Environment]) -> Callable[[int, Any, dict], Environment]:
    """A built-in that takes no env.args: any given are refused, naming them."""

    def build(seed: int, tokenizer: Any, args: dict) -> Environment:
        if args:
            raise ValueError(f"takes no env.args; got {sorted(args)}")
        return make(seed, tokenizer)

    return build


# env.name -> how the built-in environment is made from the run's seed, its tokenizer and env.args
BUILTIN_ENVIRONMENTS: dict[str, Callable[[int, Any, dict], Environment]] = {
    "digit_relay": _without_args(lambda seed, tokenizer: DigitRelay(seed=seed)),
    "calculator": _without_args(lambda seed, tokenizer: Calculator(tokenizer, seed=seed)),
    **ADAPTERS,
}


class EnvironmentLoadError(TandemError, ValueError):
    """env.name does not give an environment; the message names the spec and why."""


def make_environment(name: str, seed: int, tokenizer: Any, max_turns: int = 0, args: dict | None = None) -> Environment:
    """The environment `name` gives: a built-in or an adapter (made with `seed`, the run's tokenizer
    and `args`, env.args), or "module:factory", a callable imported from sys.path (the launch
    directory included) and called as factory(**args). max_turns > 0 lowers the environment's own
    cap on model turns."""
    args = dict(args or {})
    if name in BUILTIN_ENVIRONMENTS:
        try:
            env = BUILTIN_ENVIRONMENTS[name](seed, tokenizer, args)
        except ValueError as error:
            raise EnvironmentLoadError(f"env.name = {name!r}: {error}") from None
    else:
        try:
            factory = import_callable(name)
            inspect.signature(factory).bind(**args)
        except ValueError as error:
            raise EnvironmentLoadError(f"env.name = {name!r}: {error}") from None
        except TypeError as error:
            raise EnvironmentLoadError(f"env.name = {name!r} cannot take env.args {sorted(args)}: {error}") from None
        env = factory(**args)
    for attribute in ("name", "max_turns", "reset", "step"):
        if not hasattr(env, attribute):
            raise EnvironmentLoadError(
                f"env.name = {name!r} gave a {type(env).__name__} without `{attribute}` (see grpo/envs/base.py)"
            )
    if max_turns:
        env.max_turns = min(env.max_turns, max_turns)
    return env
