"""Gradient compression: quantizer, sparsifier, entropy coder, wire format, error feedback.

Imports no ray, so everything here tests in one CPU process.
"""

from tail_ray.compression.base import Compressor
from tail_ray.compression.registry import compressor_names, make_compressor
from tail_ray.compression.stats import LayerStats

__all__ = ["Compressor", "LayerStats", "compressor_names", "make_compressor"]
