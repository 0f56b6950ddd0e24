"""Run configuration: the sections (sections.py) and their keys (keys.py), TOML files and
`--section.key=value` overrides in and out (io.py), the run folder's record of them (record.py),
and validation (checks.py), which finds every impossible setting, the rank layout included, before
any process group exists. Importing this package loads no torch.

`load_config` is the one entry point: a bad setting fails on every rank with the same one-line
`ConfigError` before any collective is issued.
"""

import os
import sys

from grpo.config.checks import validate_config
from grpo.config.io import _build_section, _parse_argv, _parse_cli_value, _read_toml, config_to_toml
from grpo.config.keys import SECTIONS, TYPES
from grpo.config.record import record_config
from grpo.config.sections import (
    ASYNC_TIS_CAP,
    AUTO_TIS_CAP,
    DEFAULT_CONFIG_PATH,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EnvConfig,
    EvalConfig,
    GenerationConfig,
    GRPOConfig,
    JobConfig,
    LoRAConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    RewardsConfig,
    TrainingConfig,
)

__all__ = [
    "ASYNC_TIS_CAP", "AUTO_TIS_CAP", "DEFAULT_CONFIG_PATH", "CheckpointConfig", "Config", "ConfigError",
    "DataConfig", "EnvConfig", "EvalConfig", "GRPOConfig", "GenerationConfig", "JobConfig", "LoRAConfig",
    "MetricsConfig", "ModelConfig",
    "OptimizerConfig", "ParallelismConfig", "RewardsConfig", "TrainingConfig", "config_to_toml", "load_config",
    "record_config", "validate_config",
]


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> Config:
    """Read `--config FILE` (default: config.toml in the repo root), apply `--section.key=value`
    or `--section.key value` overrides, and validate for `world_size` ranks (default: $WORLD_SIZE)."""
    if argv is None:
        argv = sys.argv[1:]
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config_path, overrides = _parse_argv(argv)
    raw = _read_toml(config_path)
    for section, key, text in overrides:
        raw.setdefault(section, {})[key] = _parse_cli_value(text, TYPES[section][key])
    cfg = Config(**{section: _build_section(section, raw.get(section, {})) for section in SECTIONS})
    validate_config(cfg, world_size)
    return cfg
