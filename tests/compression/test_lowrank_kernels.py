"""The low-rank path's fixed-order linear algebra (lowrank_kernels.py) against LAPACK / BLAS.

The kernels replace torch's QR and products and numpy's eigh so the factors are the same bits
on every CPU (tests/compression/isa_digest.py checks that under other builds); here they must
also be the right answer: P orthonormal, Q = M^T P, P Q^T the same projection LAPACK's QR
gives, and the captured energies LAPACK's eigenvalues.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tail_ray.bitwidth.lowrank_choice import random_directions
from tail_ray.compression.lowrank_kernels import captured_energy_arrays, power_step_arrays


@pytest.mark.parametrize(("rows", "cols", "rank"), [(128, 784, 16), (131, 257, 8), (7, 5, 3), (1, 9, 1)])
def test_a_power_step_is_the_qr_projection(rows: int, cols: int, rank: int) -> None:
    rng = np.random.default_rng(rows)
    m = rng.standard_normal((rows, cols)).astype(np.float32)
    q = rng.standard_normal((cols, rank)).astype(np.float32)
    p, q_next = power_step_arrays(m, q)
    assert p.dtype == q_next.dtype == np.float32 and p.shape == (rows, rank) and q_next.shape == (cols, rank)
    live = min(rows, rank)  # columns beyond the row count have no new direction
    assert np.allclose(p.T @ p, np.diag([1.0] * live + [0.0] * (rank - live)), atol=1e-5)
    np.testing.assert_allclose(q_next, m.T.astype(np.float64) @ p, rtol=1e-4, atol=1e-4)
    # The projection P P^T M is LAPACK's, whatever the columns' signs.
    p_ref, _ = np.linalg.qr(m.astype(np.float64) @ q.astype(np.float64))
    ref = p_ref[:, :live] @ (p_ref[:, :live].T @ m)
    np.testing.assert_allclose(p @ q_next.T, ref, rtol=1e-3, atol=1e-4 * np.abs(ref).max())


def test_a_direction_with_nothing_new_sends_nothing() -> None:
    rng = np.random.default_rng(0)
    m = rng.standard_normal((64, 32)).astype(np.float32)
    q = rng.standard_normal((32, 4)).astype(np.float32)
    q[:, 3] = q[:, 1]  # the same direction twice
    p, q_next = power_step_arrays(m, q)
    assert not p[:, 3].any() and not q_next[:, 3].any()
    assert np.isfinite(p).all() and np.isfinite(q_next).all()
    zero_p, zero_q = power_step_arrays(np.zeros((16, 8), np.float32), q[:8])
    assert not zero_p.any() and not zero_q.any()


@pytest.mark.parametrize("rank", [1, 2, 5, 16])
def test_captured_energy_is_the_gram_spectrum(rank: int) -> None:
    rng = np.random.default_rng(rank)
    q = (rng.standard_normal((300, rank)) * np.geomspace(10, 0.1, rank)).astype(np.float32)
    captured, basis = captured_energy_arrays(q)
    values = np.linalg.eigvalsh(q.astype(np.float64).T @ q.astype(np.float64))[::-1]
    np.testing.assert_allclose(captured, np.cumsum(values), rtol=1e-10)
    # The basis is Q rotated onto its singular directions: orthogonal columns, best first.
    gram = basis.astype(np.float64).T @ basis.astype(np.float64)
    np.testing.assert_allclose(np.diag(gram), values, rtol=1e-5)
    assert np.abs(gram - np.diag(np.diag(gram))).max() <= 1e-5 * values[0]


def test_captured_energy_of_degenerate_and_zero_factors() -> None:
    q = np.zeros((50, 4), np.float32)
    q[:, 0] = 1.0
    q[:, 2] = 1.0  # two equal directions, two empty ones
    captured, basis = captured_energy_arrays(q)
    np.testing.assert_allclose(captured, [100.0, 100.0, 100.0, 100.0], atol=1e-9)
    assert np.isfinite(basis).all()
    captured, _ = captured_energy_arrays(np.zeros((10, 3), np.float32))
    assert not captured.any()


def test_random_directions_are_signs_from_the_seed() -> None:
    a = random_directions(100, 4, torch.Generator().manual_seed(3))
    b = random_directions(100, 4, torch.Generator().manual_seed(3))
    assert a.dtype == torch.float32 and a.shape == (100, 4)
    assert torch.equal(a, b) and set(a.unique().tolist()) == {-1.0, 1.0}
    assert not torch.equal(a, random_directions(100, 4, torch.Generator().manual_seed(4)))
