"""Adapters: environments of other RL libraries, played by the run's model through tandem's
`Environment` interface. Each is a built-in `env.name` whose settings are `env.args`:

- `verifiers` (verifiers.py): a verifiers 0.4 environment, `env.args` being its `[env]` config;
- `skyrl_gym` (skyrl_gym.py): a SkyRL-Gym text environment, `env.args` naming its `env_class`.

Their packages are optional extras, imported only when an adapter is built, so a missing one
fails at start-up with one line naming the extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

# env.name -> the adapter made from the run's seed, its tokenizer and env.args
ADAPTERS: dict[str, Callable[[int, Any, dict], Any]] = {
    "verifiers": lambda seed, tokenizer, args: _adapter("verifiers", "verifiers.v1", "verifiers")
    .VerifiersEnvironment(tokenizer, args),
    "skyrl_gym": lambda seed, tokenizer, args: _adapter("skyrl_gym", "skyrl_gym", "skyrl-gym")
    .SkyRLGymEnvironment(tokenizer, args),
}


def _adapter(module: str, package: str, extra: str) -> ModuleType:
    """grpo.envs.adapters.`module`, after checking that `package` imports: a ValueError naming the
    extra that installs it otherwise."""
    try:
        importlib.import_module(package)
    except ImportError as error:
        raise ValueError(f"needs the {extra} package ({error}): pip install -e \".[{extra}]\"") from None
    return importlib.import_module(f"grpo.envs.adapters.{module}")
