"""tail-ray: Tail gradient compression for PyTorch DDP on Ray Train."""

# First (sorted first, too): registers where numba caches tail_ray's kernels, which must
# happen before any kernel module is imported.
from tail_ray import kernel_cache  # noqa: F401
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
