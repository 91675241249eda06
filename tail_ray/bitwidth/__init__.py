"""The bit-width controller: per-layer bit choice under an error budget, and its statistics."""

# tail_ray.compression first, always: it registers numba's cache locator before any kernel
# compiles, and its package imports quant_error (qsgd uses it) while quant_error uses
# compression's fixed-order sums. Entering the cycle from compression's end is the one order
# in which both halves finish loading.
import tail_ray.compression  # noqa: F401
