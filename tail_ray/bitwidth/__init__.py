"""The bit-width controller: per-layer bit choice under an error budget, and its statistics."""

# First: registers numba's cache locator before quant_error's kernels compile (see
# tail_ray/compression/__init__.py).
from tail_ray import kernel_cache  # noqa: F401
