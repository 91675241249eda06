"""The compressor registry: one explicit table from name to settings class and constructor."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tail_ray.compression.base import Compressor
from tail_ray.compression.qsgd import QSGDCompressor, QSGDConfig
from tail_ray.compression.raw import RawCompressor
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.topk import TopKCompressor, TopKConfig
from tail_ray.errors import ConfigError
from tail_ray.settings import NoSettings, settings_from_mapping


@dataclass(frozen=True)
class CompressorEntry:
    """How to build one compressor: its frozen settings class and a constructor taking it."""

    settings: type[Any]
    build: Callable[[Any], Compressor]


COMPRESSORS: Mapping[str, CompressorEntry] = {
    "none": CompressorEntry(NoSettings, lambda _: RawCompressor()),
    "qsgd": CompressorEntry(QSGDConfig, QSGDCompressor),
    "topk": CompressorEntry(TopKConfig, TopKCompressor),
    "tail": CompressorEntry(TailConfig, TailCompressor),
}


def compressor_names() -> list[str]:
    return sorted(COMPRESSORS)


def compressor_entry(name: str) -> CompressorEntry:
    """The table's entry for ``name``; an unknown name raises ``ConfigError`` listing the known."""
    try:
        return COMPRESSORS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown compressor {name!r}; choose one of {compressor_names()}") from None


def make_compressor(name: str, **settings: Any) -> Compressor:
    """Build a compressor by name; unknown names and settings raise ``ConfigError``."""
    entry = compressor_entry(name)
    config = settings_from_mapping(entry.settings, settings, what=f"compressor {name!r}")
    return entry.build(config)
