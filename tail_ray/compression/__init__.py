"""Gradient compression: the compressor contract, its compressors, and the codec under them.

Imports no ray, so everything here tests in one CPU process.
"""

from tail_ray.compression.base import Compressor
from tail_ray.compression.registry import COMPRESSORS, compressor_names, make_compressor
from tail_ray.compression.stats import LayerStats

__all__ = ["COMPRESSORS", "Compressor", "LayerStats", "compressor_names", "make_compressor"]
