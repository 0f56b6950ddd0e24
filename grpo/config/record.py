"""The run folder's record of its settings: `<job.output_dir>/config.toml`, the resolved config of
the latest launch. A launch that resumes with other settings keeps the earlier record beside it,
so that every step's settings stay on disk, and says which keys changed."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from grpo.config.io import _toml_value, config_to_toml
from grpo.config.sections import Config

# Changed keys named in the line; the rest are counted.
_NAMED_CHANGES = 6
# A key one of the two records lacks (a setting added or removed between versions).
_MISSING = object()


def record_config(cfg: Config, path: str | Path, resumed_step: int | None) -> str:
    """Write the resolved config to `path` (creating its folder). When resuming after step
    `resumed_step` over a record that says something else, first rename that one
    config.until_step_N.toml (the steps up to N ran under it). Returns the line that says so, or ""."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = config_to_toml(cfg)
    note = ""
    if resumed_step is not None and path.is_file():
        earlier = path.read_bytes()
        if earlier != text.encode("utf-8"):
            kept = _free_name(path.with_name(f"config.until_step_{resumed_step}.toml"))
            path.replace(kept)
            note = f"resuming with changed settings ({_changes(earlier, text)}); the earlier config.toml is kept as {kept}"
    path.write_text(text, encoding="utf-8")
    return note


def _changes(earlier: bytes, text: str) -> str:
    """The keys whose values differ, as "section.key old -> new", from the two TOML texts."""
    try:
        before = _flat(tomllib.loads(earlier.decode("utf-8")))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return "the earlier config.toml could not be read"
    after = _flat(tomllib.loads(text))
    changed = [
        f"{key} {_shown(before, key)} -> {_shown(after, key)}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key, _MISSING) != after.get(key, _MISSING)
    ]
    if len(changed) > _NAMED_CHANGES:
        changed = changed[:_NAMED_CHANGES] + [f"{len(changed) - _NAMED_CHANGES} more"]
    return ", ".join(changed) or "only its layout"


def _flat(tables: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, table in tables.items() for key, value in table.items()}


def _shown(values: dict[str, Any], key: str) -> str:
    return _toml_value(values[key]) if key in values else "(absent)"


def _free_name(path: Path) -> Path:
    """`path`, or path with -2, -3, ... before its suffix when taken (a second resume from one step)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate
