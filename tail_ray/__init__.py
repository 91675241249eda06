"""tail-ray: Tail gradient compression for PyTorch DDP on Ray Train."""

from tail_ray.compression import Compressor, LayerStats, compressor_names, make_compressor
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.errors import CodecError, ConfigError, TailError

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
