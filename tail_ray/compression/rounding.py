"""How a value between two levels is rounded, and which rounding a layer gets.

The kernels (quantize.py, the controller's error model in bitwidth/quant_error.py) take a
``ROUNDINGS`` value, on either backend (the numba kernels and the Triton ones round the same
way); ``TailConfig.rounding`` takes a ``ROUNDING_MODES`` one, whose "auto" is resolved by
``kernel_rounding``.
"""

from __future__ import annotations

from tail_ray.errors import ConfigError

__all__ = [
    "ROUNDINGS",
    "ROUNDING_MODES",
    "is_dither",
    "is_nearest",
    "kernel_rounding",
]

# How a value between two levels is rounded: "stochastic" (unbiased), "nearest" (halves
# away from zero: about half the error at the same bits, biased per call, which error feedback
# carries into the next call) or "dither" (subtractive dither, issue 15: level = floor(t + u)
# with u ~ U[0, 1) drawn from the layer's seed, which the payload carries, and the receiver
# subtracts u again: an error uniform on +-step/2 whatever the value, unbiased, independent of
# the gradient, with no error feedback; docs/engine.md, "Subtractive dither in the engine").
ROUNDINGS = ("stochastic", "nearest", "dither")
# What TailConfig.rounding takes: a kernel's rounding, or "auto" (the default), resolved by
# ``kernel_rounding``. "auto" stays a setting of its own so that a later, measured change of
# the default reaches configs that did not pin one.
ROUNDING_MODES = ("auto", *ROUNDINGS)


def kernel_rounding(rounding: str) -> str:
    """The kernel rounding of a ``ROUNDING_MODES`` setting: "auto" is dither, on both backends
    and also slice by slice in the sharded exchanges (docs/engine.md, "Subtractive dither by
    default"); an explicit choice is kept. A ConfigError for anything else."""
    if rounding == "auto":
        return "dither"
    is_nearest(rounding)
    return rounding


def is_nearest(rounding: str) -> bool:
    """Whether ``rounding`` is "nearest"; a ConfigError for anything not in ROUNDINGS."""
    if rounding not in ROUNDINGS:
        raise ConfigError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    return rounding == "nearest"


def is_dither(rounding: str) -> bool:
    """Whether ``rounding`` is "dither"; a ConfigError for anything not in ROUNDINGS."""
    is_nearest(rounding)
    return rounding == "dither"
