"""The one-line refusal every config check raises: `key = value why`."""

from __future__ import annotations

from typing import Any

from grpo.config.io import _toml_value
from grpo.config.sections import ConfigError


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Refuse `key = value` unless ok, saying why."""
    if not ok:
        raise ConfigError(f"{key} = {_toml_value(value)} {why}")


def require_multiple(prompts: int, divisor: int, divisor_desc: str, why: str) -> None:
    """Refuse data.prompts_per_step unless divisor splits it, suggesting the nearest multiples."""
    lower = prompts // divisor * divisor
    examples = " or ".join(str(n) for n in (lower, lower + divisor) if n > 0)
    require(
        prompts % divisor == 0,
        "data.prompts_per_step",
        prompts,
        f"is not divisible by {divisor_desc} ({why}); "
        f"set --data.prompts_per_step to a multiple of {divisor}, e.g. {examples}",
    )
