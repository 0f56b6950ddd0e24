"""reasoning-gym datasets as a prompt source: `data.path = "reasoning_gym:NAME"`, with the
dataset's own config keys in `data.reasoning_gym` (e.g. `{min_digits = 1, max_digits = 2}`).

Problems are generated offline and deterministically (`gym_records`; grpo/data/sources.py turns them
into a run's prompts). Each prompt carries its reasoning-gym entry in its metadata, which the
`reasoning_gym` reward (rewards.py) hands to the dataset's `score_answer`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

PREFIX = "reasoning_gym:"
# The held-out problems' seed is job.seed + this: a generator stream of its own.
HELD_OUT_SEED_OFFSET = 1_000_003


def is_gym_path(path: str) -> bool:
    return path.startswith(PREFIX)


def _registry() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(
            "data.path = 'reasoning_gym:...' needs the reasoning-gym package: pip install -e '.[reasoning-gym]'"
        ) from None
    return DATASETS


def check_gym_config(path: str, options: dict[str, Any]) -> None:
    """Raise ValueError, in one line naming the culprit, unless `path` names a reasoning-gym
    dataset and `options` are valid keys and values of its config class."""
    name = path[len(PREFIX) :]
    datasets = _registry()
    if name not in datasets:
        match = difflib.get_close_matches(name, list(datasets), n=1)
        hint = f" (did you mean '{PREFIX}{match[0]}'?)" if match else ""
        raise ValueError(f"data.path = {path!r}: reasoning-gym has no dataset {name!r}{hint}")
    config_class = datasets[name][1]
    fields = [f.name for f in dataclasses.fields(config_class) if f.name not in ("seed", "size")]
    for key in options:
        if key not in fields:
            match = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean '{match[0]}'?)" if match else f" ({name} takes: {', '.join(fields)})"
            raise ValueError(f"data.reasoning_gym.{key} is not a config key of reasoning-gym's {name!r}{hint}")
    try:
        config_class(seed=0, size=1, **options).validate()
    except (AssertionError, TypeError, ValueError) as error:
        raise ValueError(f"data.reasoning_gym = {options!r} is refused by reasoning-gym's {name!r}: {error}") from None


def gym_records(name: str, options: dict[str, Any], size: int, seed: int) -> list[dict]:
    """`size` problems of dataset `name` as prompt records (see datasets.read_records)."""
    from reasoning_gym import create_dataset

    dataset = create_dataset(name, size=size, seed=seed, **options)
    records = []
    for i in range(size):
        entry = dataset[i]
        records.append({
            "text": entry["question"],
            "answer": str(entry["answer"]),
            "metadata": {"reasoning_gym": {"dataset": name, "config": dict(options), "entry": entry}},
            "source": f"{PREFIX}{name}[{i}] (seed {seed})",
        })
    return records
