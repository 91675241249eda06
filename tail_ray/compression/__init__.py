"""Gradient compression: the compressor contract, its compressors, and the codec under them.

Imports no ray, so everything here tests in one CPU process.
"""

# First: registers where numba caches tail_ray's kernels, which must happen before any kernel
# module is imported. Here rather than in tail_ray/__init__.py so that the torch-free parts
# of the package (tail_ray.jobspec, tail_ray.methods) load no numba.
from tail_ray import kernel_cache  # noqa: F401, I001

from tail_ray.compression.base import Compressor
from tail_ray.compression.registry import COMPRESSORS, compressor_names, make_compressor
from tail_ray.compression.stats import LayerStats

__all__ = ["COMPRESSORS", "Compressor", "LayerStats", "compressor_names", "make_compressor"]
