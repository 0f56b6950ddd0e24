"""Every config key, read off the section dataclasses (sections.py): the sections, each key's type,
the full "section.key" names, and the words a `Literal` key accepts."""

import dataclasses
import typing
from typing import Any, Literal

from grpo.config.sections import Config

# section name -> section dataclass, in file order
SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
# section name -> {key: type}
TYPES: dict[str, dict[str, Any]] = {
    name: {f.name: f.type for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()
}
ALL_KEYS = [f"{section}.{key}" for section, keys in TYPES.items() for key in keys]

# "section.key" -> its allowed values, read off the Literal annotations
CHOICES: dict[str, tuple[str, ...]] = {
    f"{section}.{key}": typing.get_args(typ)
    for section, keys in TYPES.items()
    for key, typ in keys.items()
    if typing.get_origin(typ) is Literal
}
