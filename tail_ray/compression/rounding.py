"""How a value between two levels is rounded, and which rounding a layer gets.

The kernels (quantize.py, the controller's error model in bitwidth/quant_error.py) take a
``ROUNDINGS`` value; ``TailConfig.rounding`` takes a ``ROUNDING_MODES`` one, whose "auto" is
resolved per layer by ``layer_rounding``: the Triton path has no nearest kernel.
"""

from __future__ import annotations

from tail_ray.errors import ConfigError

__all__ = ["NEAREST_ON_DEVICE", "ROUNDINGS", "ROUNDING_MODES", "is_nearest", "layer_rounding"]

# How a value between two levels is rounded: "stochastic" (unbiased) or "nearest" (halves
# away from zero: about half the error at the same bits, biased per call, which error feedback
# carries into the next call).
ROUNDINGS = ("stochastic", "nearest")
# What TailConfig.rounding takes: a kernel's rounding, or "auto" (the default), resolved per
# layer by ``layer_rounding``.
ROUNDING_MODES = ("auto", *ROUNDINGS)
# The Triton kernels (quantizer and the controller's estimate) round stochastically only.
NEAREST_ON_DEVICE = (
    "rounding='nearest' runs on the CPU kernels only; the Triton (CUDA) path rounds stochastically: "
    "use rounding='auto' (the default: stochastic there) or 'stochastic' for CUDA gradients"
)


def layer_rounding(rounding: str, on_device: bool) -> str:
    """The kernel rounding one layer gets from a ``ROUNDING_MODES`` setting: "auto" is nearest
    on the CPU kernels and stochastic on the Triton path (``on_device``), which has no nearest
    kernel; an explicit choice is kept (nearest on the Triton path then raises there, with
    NEAREST_ON_DEVICE). A ConfigError for anything else."""
    if rounding == "auto":
        return "stochastic" if on_device else "nearest"
    is_nearest(rounding)
    return rounding


def is_nearest(rounding: str) -> bool:
    """Whether ``rounding`` is "nearest"; a ConfigError for anything not in ROUNDINGS."""
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    return rounding == "nearest"
