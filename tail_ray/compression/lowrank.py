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

from collections.abc import Callable

import numpy as np
import torch
from numba import njit

from tail_ray.compression.device import DeviceFlat, LayerArray
from tail_ray.compression.feedback import ErrorFeedback
from tail_ray.compression.grid import SCALE_BYTES
from tail_ray.compression.lowrank_kernels import power_step_arrays
from tail_ray.compression.quantize import dequantize, n_buckets, quantize_finite, sum_squares
from tail_ray.compression.records import LowRankRecord

# M = g + e of a layer: numpy for the host path, a flat float32 tensor on the gradient's device
# for a CUDA layer (lowrank_device.py), which never leaves it.
Matrix = np.ndarray | torch.Tensor
PowerStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

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
    return (levels * bits + 7) // 8 + SCALE_BYTES * scales + 32


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


def quantize_factors(
    name: str,
    p: torch.Tensor,
    q: torch.Tensor,
    rows: int,
    cols: int,
    *,
    bits: int,
    bucket_size: int,
    seed: int,
) -> LowRankRecord:
    """The record that sends P (rows x rank) and Q (cols x rank), each transposed to rank-major
    and quantized on Tail's grid from its own salt of ``seed``."""
    p_levels, p_scales = _quantize_factor(p.T.contiguous().numpy(), bits, bucket_size, seed ^ _P_SALT)
    q_levels, q_scales = _quantize_factor(q.T.contiguous().numpy(), bits, bucket_size, seed ^ _Q_SALT)
    rank = int(q.shape[1])
    return LowRankRecord(name, rows, cols, rank, bits, bucket_size, p_scales, p_levels, q_scales, q_levels)


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
    ``compensated - reconstruction``, exactly. (A CUDA layer: lowrank_device.py.)
    """
    m = torch.from_numpy(compensated).view(rows, cols)
    p, q = power_step(m, q_warm)
    rec = quantize_factors(name, p, q, rows, cols, bits=bits, bucket_size=bucket_size, seed=seed)
    return rec, q, reconstruct(rec)


def compensated_of(feedback: ErrorFeedback, name: str, g: LayerArray) -> Matrix:
    """M = g + e for a low-rank step or trial: on the host for a numpy layer, on the device for a
    CUDA one (its residual moved there, once, if it was on the host)."""
    if isinstance(g, DeviceFlat):
        from tail_ray.compression import lowrank_device

        return lowrank_device.compensate(g, feedback.device_buffer(name, g.size, g.tensor.device))
    return feedback.compensate(name, g)


def trial_view(compensated: Matrix, rows: int, cols: int) -> tuple[torch.Tensor, float, PowerStep]:
    """A trial's M as a rows x cols tensor, ||M||^2 (the project's fixed-order sum on the host),
    and the power step that runs where M is."""
    if isinstance(compensated, np.ndarray):
        return torch.from_numpy(compensated).view(rows, cols), float(sum_squares(compensated)), power_step
    from tail_ray.compression import lowrank_device

    m_sq = lowrank_device.sum_squares(compensated)
    return compensated.view(rows, cols), m_sq, lowrank_device.power_step_device


def send_lowrank(
    feedback: ErrorFeedback,
    name: str,
    compensated: Matrix,
    shape: tuple[int, int],
    q_warm: torch.Tensor,
    *,
    bits: int,
    bucket_size: int,
    seed: int,
) -> tuple[LowRankRecord, torch.Tensor, float, float]:
    """Factor M = ``compensated`` where it is and leave M less what receivers reconstruct in the
    layer's residual: (record, next warm start Q, ||e||^2 left, ||M||^2)."""
    rows, cols = shape
    if isinstance(compensated, np.ndarray):
        rec, q_next, recon = compress_lowrank(
            name, compensated, rows, cols, q_warm, bits=bits, bucket_size=bucket_size, seed=seed
        )
        feedback.update(name, compensated, recon)
        return rec, q_next, feedback.norm_sq(name), float(sum_squares(compensated))
    from tail_ray.compression import lowrank_device

    rec, q_next, recon_dev = lowrank_device.compress_lowrank_device(
        name, compensated, rows, cols, q_warm, bits=bits, bucket_size=bucket_size, seed=seed
    )
    e = feedback.device_buffer(name, compensated.numel(), compensated.device)
    feedback.measured(name, lowrank_device.update_residual(e, compensated, recon_dev))
    return rec, q_next, feedback.norm_sq(name), lowrank_device.sum_squares(compensated)


def residual_norm_sq(residual: np.ndarray) -> float:
    """||e||^2 in the project's fixed summation order (fixedsum.py)."""
    return float(sum_squares(residual))
