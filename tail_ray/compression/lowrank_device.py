"""Low-rank layers of CUDA gradients (the Triton backend): the layer-sized work on the device.

The host path (lowrank.py) factors M = g + e with fixed-order numba products, so that a run is
the same run on every CPU. For a CUDA gradient that would copy M to the host and multiply it
there on one core every step, which is why CUDA layers used to be quantized only (a digits-like
model on a GPU sent ~3x what it sends on a CPU). Here the work that scales with the layer stays
on its device, and the work that scales with the rank goes to the host kernels unchanged:

    M = sat(g + e)                  device (e is the device residual, error feedback's)
    M Q_warm, M^T P                 device: torch matmuls (any order, TF32 if the user allows it)
    orthonormalize(M Q_warm)        host: lowrank_kernels' Gram-Schmidt on rows x rank numbers
    quantize(P), quantize(Q)        host: the grid's quantizer, as lowrank.compress_lowrank
    reconstruct(sent)               device: ``_reconstruct_kernel``, the bits of the numba one
    e = M - reconstruct(sent)       device

Only the sender's factors come from an order the device picks: which P and Q a rank sends is
its own business (every receiver decodes the bytes it got). What must agree is the
reconstruction, because the sender's residual is M less exactly what every receiver adds to its
mean: the kernel here sums over the rank in order, in float64 (a product of two float32 values
is exact there, so a fused multiply-add changes nothing), and rounds once to float32, as
``lowrank._reconstruct_core`` does: the same bits on a GPU and on any CPU
(tests/compression/test_lowrank_device.py). A receiver with CUDA gradients reconstructs every
rank's record here and averages on the device in the grid's order (``mean_tensors_on_device``).

Imported only once the Triton backend is chosen (triton is an optional extra).
"""

# Triton kernels are typed by Triton, not mypy.
# mypy: disable-error-code="no-untyped-def,name-defined,valid-type,attr-defined"

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import triton
import triton.language as tl

from tail_ray.compression.device import DeviceFlat
from tail_ray.compression.grid import F32_MAX
from tail_ray.compression.lowrank import factors, quantize_factors
from tail_ray.compression.lowrank_kernels import _orthonormalize
from tail_ray.compression.records import LowRankRecord

__all__ = [
    "compensate",
    "compress_lowrank_device",
    "mean_tensors_on_device",
    "power_step_device",
    "reconstruct_on",
    "sum_squares",
    "update_residual",
]

# Output tile of the reconstruction: 32 x 64 float64 accumulators per program.
_TILE_ROWS = 32
_TILE_COLS = 64


@triton.jit(do_not_specialize=["rows", "cols", "rank"])
def _reconstruct_kernel(
    p_ptr, q_ptr, out_ptr, rows, cols, rank, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    """out[i * cols + j] = float32(sum_c float64(p[c * rows + i]) * float64(q[c * cols + j])),
    c in order from 0: ``lowrank._reconstruct_core`` per element."""
    # One grid axis (CUDA allows 2^31 - 1 programs there, 65,535 on the others): program pid
    # takes row tile pid // col_tiles and column tile pid % col_tiles.
    col_tiles = tl.cdiv(cols, BLOCK_C)
    pid = tl.program_id(0)
    ri = (pid // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
    ci = (pid % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = ri < rows
    cmask = ci < cols
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float64)
    for c in range(rank):
        pc = tl.load(p_ptr + c * rows + ri, mask=rmask, other=0.0).to(tl.float64)
        qc = tl.load(q_ptr + c * cols + ci, mask=cmask, other=0.0).to(tl.float64)
        acc = acc + pc[:, None] * qc[None, :]
    offs = ri[:, None].to(tl.int64) * cols + ci[None, :]
    tl.store(out_ptr + offs, acc.to(tl.float32), mask=rmask[:, None] & cmask[None, :])


def reconstruct_on(rec: LowRankRecord, device: torch.device) -> torch.Tensor:
    """The layer a low-rank record stands for, flat float32 on ``device``: ``lowrank.reconstruct``'s
    bits. The factors are dequantized on the host ((rows + cols) x rank numbers) and go up."""
    p, q = factors(rec)
    p_dev = torch.from_numpy(np.ascontiguousarray(p)).to(device)
    q_dev = torch.from_numpy(np.ascontiguousarray(q)).to(device)
    out = torch.empty(rec.numel, dtype=torch.float32, device=device)
    grid = (triton.cdiv(max(rec.rows, 1), _TILE_ROWS) * triton.cdiv(max(rec.cols, 1), _TILE_COLS),)
    _reconstruct_kernel[grid](
        p_dev, q_dev, out, rec.rows, rec.cols, rec.rank,
        BLOCK_R=_TILE_ROWS, BLOCK_C=_TILE_COLS, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def sum_squares(x: torch.Tensor) -> float:
    """||x||^2 in float64 on x's device (device_codec's kernel: deterministic on one device)."""
    from tail_ray.compression import device_codec

    return device_codec.sum_squares(DeviceFlat(x.reshape(-1)))


def compensate(g: DeviceFlat, e: torch.Tensor) -> torch.Tensor:
    """M = g + e as a new flat float32 tensor, saturated at float32's max (feedback.compensate)."""
    return torch.add(g.tensor, e).clamp_(-float(F32_MAX), float(F32_MAX))


def update_residual(e: torch.Tensor, compensated: torch.Tensor, sent: torch.Tensor) -> float:
    """e <- compensated - sent, in place; returns ||e||^2."""
    torch.sub(compensated, sent, out=e)
    return sum_squares(e)


def power_step_device(m: torch.Tensor, q_warm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowrank.power_step`` with m (rows x cols, float32) on its device: (P, Q) on the host,
    float32, P orthonormal (the host's Gram-Schmidt: zero columns where M Q_warm has no new
    direction), Q = M^T P. The two products run on the device; only rows x rank and cols x
    rank numbers cross."""
    q_dev = q_warm.to(device=m.device, dtype=torch.float32)
    mq = (m @ q_dev).cpu().numpy()
    p64 = _orthonormalize(np.ascontiguousarray(mq, dtype=np.float32))
    p = torch.from_numpy(p64.astype(np.float32))
    q = (m.t() @ p.to(m.device)).cpu()
    return p, q


def compress_lowrank_device(
    name: str,
    compensated: torch.Tensor,
    rows: int,
    cols: int,
    q_warm: torch.Tensor,
    *,
    bits: int,
    bucket_size: int,
    seed: int,
) -> tuple[LowRankRecord, torch.Tensor, torch.Tensor]:
    """``lowrank.compress_lowrank`` for M = ``compensated`` on its device: the record, the next
    warm start (Q, host) and the reconstruction on the device (the caller's residual is
    ``compensated - reconstruction``, exactly what every receiver decodes)."""
    p, q = power_step_device(compensated.view(rows, cols), q_warm)
    rec = quantize_factors(name, p, q, rows, cols, bits=bits, bucket_size=bucket_size, seed=seed)
    return rec, q, reconstruct_on(rec, compensated.device)


def mean_tensors_on_device(tensors: Iterable[torch.Tensor], out: torch.Tensor) -> None:
    """out <- the grid's rank mean of flat float32 tensors (in rank order) on out's device:
    float64 sum in rank order, divided by the number of ranks, rounded to float32
    (``rank_mean.mean_into``'s bits: every step is one IEEE operation per element). The ranks
    are added one at a time as ``tensors`` yields them (a generator keeps one rank's layer in
    memory besides the float64 sum)."""
    acc: torch.Tensor | None = None
    world = 0
    for t in tensors:
        if acc is None:
            acc = t.to(device=out.device, dtype=torch.float64, copy=True)
        else:
            acc.add_(t)  # widened to float64 exactly, added in float64
        world += 1
    if acc is None:
        raise ValueError("the mean needs at least one rank")
    # By a tensor, not a Python number: CUDA's division by a host scalar multiplies by its
    # reciprocal, which is not the grid's division for a world that is not a power of two.
    acc.div_(torch.full((1,), float(world), dtype=torch.float64, device=acc.device))
    out.copy_(acc.view(out.shape))  # rounded to float32 once
