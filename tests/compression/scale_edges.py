"""Bucket max-abs values at the 16-bit scale grid's edges, shared by the CPU and Triton tests."""

from __future__ import annotations

import numpy as np

from tail_ray.compression.grid import F32_MAX, MAX_SCALE, scales_up_reference


def edge_max_abs() -> np.ndarray:
    """Max-abs values at the 16-bit scale grid's edges: on it, one ulp either side, float32's
    max and the grid's largest value, between them, subnormals on and off the grid, zero."""
    on = np.array([1.0, 0.5, 3.0e-3], np.float32)
    on = scales_up_reference(on)  # on the grid already
    grid_top = np.array([MAX_SCALE], np.float32)
    return np.concatenate(
        [
            on,
            np.nextafter(on, np.float32(np.inf)),
            np.nextafter(on, np.float32(0)),
            grid_top,
            np.nextafter(grid_top, np.float32(np.inf)),
            np.array([F32_MAX, 2.0**-134, 1.4e-45, 1.1e-38, 1.2e-38, 0.0], np.float32),
        ]
    ).astype(np.float32)
