"""Settings mappings (a job's ``compression:`` block) into frozen settings dataclasses, with clear errors.

Every method and compressor declares its settings as a frozen dataclass whose
``__post_init__`` validates the values; this module is the one place that turns a user's
mapping into such a class, so an unknown key or a non-mapping gets the same kind of message
everywhere: what was given, and what is accepted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from tail_ray.errors import ConfigError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """The settings of a method that takes none (none, fp16, bf16)."""


def coerce_fields(settings: object, **casts: Callable[[Any], Any]) -> None:
    """In a frozen settings dataclass's ``__post_init__``: store ``cast(value)`` for each named
    field (YAML and ``--set`` give ``4.0`` for 4 or ``1`` for true), after validation."""
    for name, cast in casts.items():
        object.__setattr__(settings, name, cast(getattr(settings, name)))


def setting_names(cls: type[Any]) -> list[str]:
    """The keys ``cls`` accepts, in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def settings_from_mapping(cls: type[T], settings: Mapping[str, Any] | None, *, what: str) -> T:
    """``cls(**settings)``, or a ``ConfigError`` that names ``what`` and says what to fix.

    ``what`` names the owner of the settings, e.g. "method 'fp16'" or "compressor 'tail'".
    Value errors come from ``cls.__post_init__`` unchanged (they already name the setting
    and its range).
    """
    if settings is None:
        settings = {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"bad settings for {what}: expected a mapping, got {type(settings).__name__}")
    known = setting_names(cls)
    unknown = sorted(str(k) for k in settings if k not in known)
    if unknown and not known:
        raise ConfigError(f"{what} takes no settings, got {unknown}; pass config=None")
    if unknown:
        raise ConfigError(f"bad settings for {what}: unknown setting(s) {unknown}; choose from {known}")
    try:
        return cls(**settings)
    except TypeError as exc:  # e.g. a value whose type __post_init__ cannot compare
        raise ConfigError(f"bad settings for {what}: {exc}") from None
