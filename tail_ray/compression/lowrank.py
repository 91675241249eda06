"""Low-rank compression of one matrix-shaped layer, with exact error feedback.

A PowerSGD step made local, so it fits the one-round all-gather (every rank's payload goes to
every rank, each decodes and averages): per layer and step, on this rank only,

    M = g + e                       (rows x cols; error feedback, e from the last step)
    P = orthonormalize(M Q_warm)    (rows x rank; one power iteration)
    Q = M^T P                       (cols x rank; kept unquantized as next step's Q_warm)
    send quantize(P), quantize(Q)   (Tail's grid at ``bits``, one scale per bucket)
    e = M - reconstruct(sent)       (exactly what every receiver will add to its mean)

PowerSGD all-reduces P and Q between the two products, so every rank shares one subspace;
here each rank factors its own M (its warm Q is its own), and the receivers add W products.
That costs a little accuracy per byte against shared factors (each rank's subspace is fitted
to its own batch), but it keeps one round, one payload and the controller's per-layer
choice between this and the quantizer.

``reconstruct`` is one numba kernel with a fixed order of operations (float64 products of
the float32 grid values, summed over the rank in order, rounded once to float32; no
fastmath), so every receiver and the sender's residual get the same bits on any CPU.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from tail_ray.compression.lowrank_kernels import power_step_arrays
from tail_ray.compression.quantize import dequantize, n_buckets, quantize_finite, sum_squares
from tail_ray.compression.records import LowRankRecord

# Salt of the factors' stochastic-rounding seed (P and Q must not share the quantizer's draws).
_P_SALT = 0x5BD1E995
_Q_SALT = 0x27D4EB2F


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(rows, cols) of a parameter seen as a matrix: (out, everything else) for 2-D and up
    (a conv weight (out, in, kh, kw) is (out, in * kh * kw)); None for vectors and scalars."""
    if len(shape) < 2 or shape[0] < 1:
        return None
    numel = int(np.prod(shape))
    return int(shape[0]), numel // int(shape[0])


def max_rank(rows: int, cols: int) -> int:
    """The largest rank whose factors hold fewer numbers than the matrix (r (rows + cols) <
    rows cols); 0 when even rank 1 does not."""
    return max(0, min(rows, cols, (rows * cols - 1) // (rows + cols)))


def factor_bytes(rows: int, cols: int, rank: int, bits: int, bucket_size: int) -> int:
    """An upper bound of a low-rank record's payload bytes: bit-packed factors (entropy codes
    only go below), their scales and up to 32 bytes of layer framing (name not counted)."""
    levels = rank * (rows + cols)
    scales = n_buckets(rank * rows, bucket_size) + n_buckets(rank * cols, bucket_size)
    return (levels * bits + 7) // 8 + 4 * scales + 32


@njit(cache=True, nogil=True)
def _reconstruct_core(p, q, rows, cols, rank, out):  # type: ignore[no-untyped-def]
    """out[i * cols + j] = float32(sum_c float64(p[c, i]) * float64(q[c, j])), c in order.

    Each element's sum runs over c in one fixed order (the loop over j vectorizes across
    elements, never across c), and a product of two float32 values is exact in float64, so
    the result does not depend on the CPU's vector width or on FMA."""
    acc = np.empty(cols, dtype=np.float64)
    for i in range(rows):
        for j in range(cols):
            acc[j] = 0.0
        for c in range(rank):
            pc = np.float64(p[c * rows + i])
            base = c * cols
            for j in range(cols):
                acc[j] += pc * np.float64(q[base + j])
        row = i * cols
        for j in range(cols):
            out[row + j] = np.float32(acc[j])


def factors(rec: LowRankRecord) -> tuple[np.ndarray, np.ndarray]:
    """The decoded factors on Tail's grid: P^T (rank x rows) and Q^T (rank x cols), flat."""
    p = dequantize(rec.p_levels, rec.p_scales, rec.bits, rec.bucket_size)
    q = dequantize(rec.q_levels, rec.q_scales, rec.bits, rec.bucket_size)
    return p, q


def reconstruct(rec: LowRankRecord, out: np.ndarray | None = None) -> np.ndarray:
    """The layer a low-rank record stands for, flat float32 (row-major rows x cols)."""
    p, q = factors(rec)
    if out is None:
        out = np.empty(rec.numel, dtype=np.float32)
    _reconstruct_core(p, q, rec.rows, rec.cols, rec.rank, out)
    return out


def _quantize_factor(x: np.ndarray, bits: int, bucket_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    levels = np.empty(flat.size, dtype=np.int8)
    scales = np.empty(n_buckets(flat.size, bucket_size), dtype=np.float32)
    quantize_finite(flat, None, bits, bucket_size, seed, levels, scales)
    return levels, scales


def power_step(m: torch.Tensor, q_warm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration of ``m`` (rows x cols) from ``q_warm`` (cols x rank): (P, Q) with P
    orthonormal (rows x rank) and Q = m^T P (cols x rank). A column of m Q_warm that vanishes
    (a zero gradient, rank above m's) gives a zero column of P and Q: it sends nothing.
    Fixed-order kernels (lowrank_kernels.py), not BLAS: the same factors on every CPU."""
    p, q = power_step_arrays(m.detach().cpu().numpy(), q_warm.detach().cpu().numpy())
    return torch.from_numpy(p), torch.from_numpy(q)


def compress_lowrank(
    name: str,
    compensated: np.ndarray,
    rows: int,
    cols: int,
    q_warm: torch.Tensor,
    *,
    bits: int,
    bucket_size: int,
    seed: int,
) -> tuple[LowRankRecord, torch.Tensor, np.ndarray]:
    """Factor M = ``compensated`` (flat float32, g + e, finite) at the rank of ``q_warm``.

    Returns the record, the next warm start (Q, unquantized, cols x rank) and what the
    receivers will reconstruct from the record (flat float32): the caller's new residual is
    ``compensated - reconstruction``, exactly.
    """
    m = torch.from_numpy(compensated).view(rows, cols)
    p, q = power_step(m, q_warm)
    rank = int(q_warm.shape[1])
    p_levels, p_scales = _quantize_factor(p.T.contiguous().numpy(), bits, bucket_size, seed ^ _P_SALT)
    q_levels, q_scales = _quantize_factor(q.T.contiguous().numpy(), bits, bucket_size, seed ^ _Q_SALT)
    rec = LowRankRecord(name, rows, cols, rank, bits, bucket_size, p_scales, p_levels, q_scales, q_levels)
    return rec, q, reconstruct(rec)


def residual_norm_sq(residual: np.ndarray) -> float:
    """||e||^2 in the project's fixed summation order (fixedsum.py)."""
    return float(sum_squares(residual))
