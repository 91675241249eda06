"""The linear algebra of the low-rank chooser's estimates: what each rank of a power
iteration's subspace keeps of M (an eigendecomposition of a small Gram matrix), and the
once-per-process warm-up that keeps the kernels' loading out of the first timed trial."""

from __future__ import annotations

import numpy as np
import torch

from tail_ray.compression.lowrank import power_step
from tail_ray.compression.lowrank_kernels import captured_energy_arrays


def captured_energy(q: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """For Q = M^T P with P orthonormal (cols x R): the energy of M that the best rank-r
    approximation inside span(P) keeps, for r = 1..R (cumulative, descending), and the
    directions that keep it (cols x R, best first: next step's warm start).

    That energy is the top r eigenvalues of the R x R Gram matrix Q^T Q (= the squared
    singular values of Q). Fixed-order kernels (compression/lowrank_kernels.py: the Gram
    product, cyclic Jacobi, the rotation), not LAPACK, so the choice it feeds is the same on
    every CPU: 0.06-0.2 ms for cols 128-1024 at R = 16 here (LAPACK's eigh: 0.05-0.07 ms)."""
    captured, basis = captured_energy_arrays(q.detach().cpu().numpy())
    return captured, torch.from_numpy(basis)


_linalg_warm = False  # warm_linalg ran in this process


def warm_linalg() -> None:
    """One tiny trial's linear algebra (power step, Gram product, Jacobi), once per process.

    A process's first call loads the kernels (numba's cache; LAPACK's code when this ran
    through it: in the benchmark's LM workers the first trial's first power step then cost
    0.6-4.4 ms of CPU, ~0.2 ms later, once 46 ms of wall), at step 20, where every layer has
    its first trial. Fixed inputs and no generator: no later draw, bit or choice changes."""
    global _linalg_warm
    if _linalg_warm:
        return
    m = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).sin()
    q = torch.arange(32 * 8, dtype=torch.float32).reshape(32, 8).cos()
    captured_energy(power_step(m, q)[1])
    _linalg_warm = True
