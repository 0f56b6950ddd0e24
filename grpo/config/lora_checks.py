"""[lora]: the adapter settings, and what LoRA runs with (one ConfigError line per bad value)."""

from __future__ import annotations

from grpo.config.io import _did_you_mean, _toml_value
from grpo.config.require import require
from grpo.config.sections import LORA_TARGETS, Config, ConfigError


def check_lora(cfg: Config) -> None:
    """Values of [lora] (checked on or off), then, when rank > 0, the trainable names."""
    lora = cfg.lora
    require(lora.rank >= 0, "lora.rank", lora.rank, "must be >= 0 (0 = off)")
    require(lora.alpha > 0, "lora.alpha", lora.alpha, "must be > 0 (the adapters' scale is alpha / rank)")
    require(
        lora.dropout == 0,
        "lora.dropout",
        lora.dropout,
        "is not supported: the adapters are merged into the weights each forward (so that trainer and generator "
        "compute with the same weights), which leaves no separate adapter input to drop; set it to 0",
    )
    require(bool(lora.targets), "lora.targets", lora.targets, f"must name at least one of {', '.join(LORA_TARGETS)}")
    for target in lora.targets:
        if target not in LORA_TARGETS:
            hint = _did_you_mean(target, list(LORA_TARGETS)) or f" (one of {', '.join(LORA_TARGETS)})"
            raise ConfigError(f"lora.targets has unknown layer {_toml_value(target)}{hint}")
    duplicates = sorted({t for t in lora.targets if lora.targets.count(t) > 1})
    require(not duplicates, "lora.targets", lora.targets, f"names {', '.join(duplicates)} more than once")
    if lora.rank == 0:
        return
    _check_trainable(cfg)


def _check_trainable(cfg: Config) -> None:
    """Each lora.trainable pattern names at least one parameter of the model, none of them an adapted weight."""
    if not cfg.lora.trainable:
        return
    # Imported here: reading a config must not load torch.
    from grpo.config.launch_checks import model_parameter_names, model_shape
    from model.lora import LoRASpec

    args = model_shape(cfg)
    names = model_parameter_names(args)
    spec = LoRASpec(cfg.lora.rank, cfg.lora.alpha, tuple(cfg.lora.targets))
    adapted = {f"{module}.weight" for module in spec.module_names(args.n_layers)}
    for pattern in cfg.lora.trainable:
        matched = [n for n in names if LoRASpec(1, 1.0, (), (pattern,)).stays_trainable(n)]
        if not matched:
            hint = _did_you_mean(pattern, names) or " (patterns match whole parameter names, e.g. 'norm.weight')"
            raise ConfigError(f"lora.trainable pattern {_toml_value(pattern)} matches no parameter of the model{hint}")
        clash = sorted(set(matched) & adapted)
        if clash:
            raise ConfigError(
                f"lora.trainable pattern {_toml_value(pattern)} matches {clash[0]}, a weight lora.targets adapts: "
                "it is the frozen base of its adapters"
            )

