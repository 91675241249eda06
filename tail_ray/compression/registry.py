"""``make_compressor(name, **settings)``: one switch for Tail and its fixed-setting peers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tail_ray.compression.base import Compressor
from tail_ray.errors import ConfigError

_FACTORIES: dict[str, Callable[..., Compressor]] = {}


def register_compressor(name: str) -> Callable[[Callable[..., Compressor]], Callable[..., Compressor]]:
    def deco(factory: Callable[..., Compressor]) -> Callable[..., Compressor]:
        _FACTORIES[name] = factory
        return factory

    return deco


def compressor_names() -> list[str]:
    _load_builtin()
    return sorted(_FACTORIES)


def make_compressor(name: str, **settings: Any) -> Compressor:
    """Build a compressor by name; unknown names and settings raise ``ConfigError``."""
    _load_builtin()
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ConfigError(f"unknown compressor {name!r}; choose one of {sorted(_FACTORIES)}") from None
    try:
        return factory(**settings)
    except TypeError as exc:
        raise ConfigError(f"bad settings for compressor {name!r}: {exc}") from None


def _load_builtin() -> None:
    # Imported lazily so that each peer stays in its own module and registers itself.
    from tail_ray.compression import qsgd, raw, tail, topk  # noqa: F401
