"""tail-ray: Tail gradient compression for PyTorch DDP on Ray Train.

The names below load on first use (PEP 562), so importing a torch-free part of the package
(``tail_ray.jobspec``, ``tail_ray.methods``, ``tail_ray.errors``) loads no torch and no numba:
the service validates job specs with them.
"""

from __future__ import annotations

import importlib
from typing import Any

from tail_ray.errors import CodecError, ConfigError, TailError

_LAZY = {
    "Compressor": "tail_ray.compression",
    "LayerStats": "tail_ray.compression",
    "compressor_names": "tail_ray.compression",
    "make_compressor": "tail_ray.compression",
    "TailCompressor": "tail_ray.compression.tail",
    "TailConfig": "tail_ray.compression.tail",
}

__all__ = [
    "CodecError",
    "Compressor",
    "ConfigError",
    "LayerStats",
    "TailCompressor",
    "TailConfig",
    "TailError",
    "compressor_names",
    "make_compressor",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tail_ray' has no attribute {name!r}")
