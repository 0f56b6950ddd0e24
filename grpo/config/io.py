"""Config text in and out: `--section.key=value` arguments and TOML files read into typed
sections, and a resolved Config written back as TOML that reads back to an equal Config."""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from pathlib import Path
from typing import Any

from grpo.config.keys import ALL_KEYS, SECTIONS, TYPES
from grpo.config.sections import DEFAULT_CONFIG_PATH, Config, ConfigError


def _parse_argv(argv: list[str]) -> tuple[Path, list[tuple[str, str, str]]]:
    config_path = DEFAULT_CONFIG_PATH
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --section.key=value")
        name, eq, text = arg[2:].partition("=")
        section, dot, key = name.partition(".")
        if name != "config":
            if not dot or not section or not key:
                match = difflib.get_close_matches(name, ALL_KEYS, n=1)
                hint = f" (did you mean '--{match[0]}'?)" if match else ""
                raise ConfigError(f"'--{name}' is not a config key; overrides look like --section.key=value{hint}")
            _check_key(section, key)
        if not eq:
            # a following "--..." is the next option, not this one's value
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"missing value for '{arg}'; write {arg}=VALUE or {arg} VALUE")
            text = argv[i + 1]
            i += 1
        i += 1
        if name == "config":
            # Path("") is the current folder, which would be reported as a config file that is a folder.
            if not text:
                raise ConfigError(f"'{arg}' names no config file; write --config=FILE or --config FILE")
            config_path = Path(text)
        else:
            overrides.append((section, key, text))
    return config_path, overrides


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot parse config file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); TOML files are UTF-8"
        ) from None
    except OSError as e:  # a folder, or a file this user may not read
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    for section, table in raw.items():
        if not isinstance(table, dict):
            if section in SECTIONS:
                raise ConfigError(f"config section '{section}' in {path} must be a table ([{section}])")
            raise ConfigError(f"unknown config key '{section}'{_did_you_mean(section, ALL_KEYS)}")
        for key in table:
            _check_key(section, key)
    return raw


def _check_key(section: str, key: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section '{section}'{_did_you_mean(section, list(SECTIONS))}")
    if key not in TYPES[section]:
        full = f"{section}.{key}"
        hint = _did_you_mean(full, ALL_KEYS) or f" ([{section}] has: {', '.join(TYPES[section])})"
        raise ConfigError(f"unknown config key '{full}'{hint}")


def _did_you_mean(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _parse_cli_value(text: str, typ: Any) -> Any:
    # TOML syntax gives lists, bools and numbers; anything TOML rejects is a bare string
    # (--job.output_dir=runs/x, --parallelism.mode=split).
    try:
        doc = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return text
    # A string key keeps its text verbatim even when it happens to read as TOML (a path named 2024, "inf").
    if set(doc) != {"v"} or (_is_text(typ) and not isinstance(doc["v"], str)):
        return text
    return doc["v"]


def _build_section(section: str, values: dict[str, Any]) -> Any:
    types = TYPES[section]
    return SECTIONS[section](**{key: _coerce(f"{section}.{key}", v, types[key]) for key, v in values.items()})


def _coerce(key: str, value: Any, typ: Any) -> Any:
    if typing.get_origin(typ) is list:
        (elem,) = typing.get_args(typ)
        if isinstance(value, list):
            bad = [v for v in value if not _is_a(v, elem)]
            if not bad:
                return [float(v) if elem is float else v for v in value]
            raise ConfigError(
                f"config key '{key}' expects {typ}, got a list holding {type(bad[0]).__name__} ({bad[0]!r})"
            )
    elif _is_a(value, typ):
        return float(value) if typ is float else value
    if typing.get_origin(typ) is typing.Literal:
        type_name = "one of " + ", ".join(f'"{word}"' for word in typing.get_args(typ))
    else:
        type_name = "str" if typ is str else typ if typing.get_origin(typ) else typ.__name__
    raise ConfigError(f"config key '{key}' expects {type_name}, got {type(value).__name__} ({value!r})")


def _is_text(typ: Any) -> bool:
    """str, or a Literal of words (whose value validate_config checks against the words)."""
    return typ is str or typing.get_origin(typ) is typing.Literal


def _is_a(value: Any, typ: Any) -> bool:
    if _is_text(typ):
        return isinstance(value, str)
    # bool is an int subclass, but `steps = true` is a mistake, not 1
    if isinstance(value, bool):
        return typ is bool
    if typ is float:
        return isinstance(value, (int, float))
    return isinstance(value, typ)

def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML that `load_config(["--config", file])` reads back to an equal Config."""
    lines = [
        "# Resolved config of this run: defaults, then the config file, then command-line overrides.",
        "# Rerun with: torchrun ... train_grpo.py --config <this file>",
    ]
    for section in dataclasses.fields(cfg):
        lines += ["", f"[{section.name}]"]
        values = getattr(cfg, section.name)
        lines += [f"{f.name} = {_toml_value(getattr(values, f.name))}" for f in dataclasses.fields(values)]
    return "\n".join(lines) + "\n"


# TOML basic-string escapes; other control characters (and DEL) become \uXXXX
_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        # float repr round-trips exactly, and its inf/nan spellings are TOML's
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(_toml_char(c) for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_char(c: str) -> str:
    if c in _TOML_ESCAPES:
        return _TOML_ESCAPES[c]
    if ord(c) < 0x20 or ord(c) == 0x7F:
        return f"\\u{ord(c):04x}"
    return c

