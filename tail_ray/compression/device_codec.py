"""The device codec: host-side wrappers of the Triton kernels (triton_kernels.py).

One layer of a CUDA gradient takes three launches and small transfers:

    sum_squares        per-block float64 partials -> ||g||^2 (finiteness and the layer norm)
    bucket_errors      the controller's sampled nu_b estimate (a few thousand elements)
    quantize           g + e, scales, levels (stochastic, nearest or dithered), e' written
                       in place, levels packed

and only the bit-packed levels (bits/32 of the fp32 gradient), the scales (one float per
bucket) and two scalars cross to the host, where the numba ``unpack_fixed`` turns them into
int8 levels for the existing entropy coder: the payload is the CPU path's wire format byte
for byte. On receipt, ``mean_into`` averages every rank's levels into the gradient on the
device (the grid's rank mean, the same bits as the numba kernel); with ``dither_seeds`` it
does the same for layers every rank dithered, subtracting each rank's uniforms (dither.py's
``mean_undithered_into``). Dither reads the shipped uniform table, copied to each device once (``_table``).

Also here: the numpy reference of the device quantizer's random stream and of the quantizer
itself (``uniform_reference``, ``quantize_reference``), which the tests hold the kernels to.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton

from tail_ray.compression import triton_kernels as K
from tail_ray.compression.bitpack import packed_bytes, unpack_fixed
from tail_ray.compression.device import MAX_DEVICE_BUCKET, DeviceFlat
from tail_ray.compression.grid import (
    F32_MAX,
    TINY_PRESCALE,
    TINY_SCALE,
    inverse_levels_max,
    levels_max,
    n_buckets,
    rank_steps,
    scales_up_reference,
)
from tail_ray.compression.kernel_parts import UNIFORM_TABLE
from tail_ray.compression.rounding import is_dither, is_nearest
from tail_ray.errors import CodecError

# Elements per program of the elementwise kernels (pack, dequantize, mean, sum of squares).
_BLOCK = 1024
# Every launch: no fused multiply-add, so products are rounded as the grid says (see
# triton_kernels' docstring).
_EXACT = {"enable_fp_fusion": False}


def _grid(n: int, block: int = _BLOCK) -> tuple[int]:
    return (max(1, triton.cdiv(n, block)),)


@functools.cache
def _table(device: torch.device) -> torch.Tensor:
    """The dither uniform table (kernel_parts.UNIFORM_TABLE, 512 KiB as int32) on ``device``,
    copied once per device: every dithered quantize and mean reads it."""
    return torch.from_numpy(UNIFORM_TABLE.astype(np.int32)).to(device)


def sum_squares(g: DeviceFlat) -> float:
    """||g||^2 in float64 (NaN/Inf when any element is): a two-level sum, deterministic on one
    device but not in the CPU's lane order, so it may differ from ``fixedsum.sum_squares`` in
    the last bits (it only feeds the finiteness check, the drift test and noise accounting)."""
    n = g.size
    partial = torch.empty(_grid(n)[0], dtype=torch.float64, device=g.tensor.device)
    K._sum_squares_kernel[_grid(n)](g.tensor, partial, n, BLOCK=_BLOCK, **_EXACT)
    return float(partial.sum())


def bucket_errors(
    g: DeviceFlat,
    residual: torch.Tensor | None,
    bucket_size: int,
    bucket_ids: np.ndarray,
    candidate_bits: tuple[int, ...],
    rounding: str = "stochastic",
) -> tuple[np.ndarray, float, int]:
    """``quant_error.bucket_errors`` on the device, the same bits: (sum of expected squared
    errors per candidate under ``rounding``, sum of squares, non-zero buckets) over
    ``bucket_ids``."""
    dev = g.tensor.device
    nc = len(candidate_bits)
    ids = torch.as_tensor(np.ascontiguousarray(bucket_ids, dtype=np.int64)).to(dev)
    lmaxes = torch.tensor([levels_max(b) for b in candidate_bits], dtype=torch.int32).to(dev)
    out = torch.empty(nc + 2, dtype=torch.float64, device=dev)
    use_e = residual is not None
    K._bucket_errors_kernel[(1,)](
        g.tensor,
        residual if use_e else g.tensor,
        ids,
        int(ids.numel()),
        g.size,
        bucket_size,
        lmaxes,
        out,
        USE_E=use_e,
        NC=nc,
        NC_POW2=triton.next_power_of_2(nc),
        NEAREST=is_nearest(rounding),
        DITHER=is_dither(rounding),
        **_EXACT,
    )
    host = out.cpu().numpy()
    return host[:nc].copy(), float(host[nc]), int(host[nc + 1])


@dataclass(frozen=True, slots=True)
class DeviceQuantized:
    """What ``quantize`` brings back to the host: int8 levels (unpacked from what crossed the
    bus), float32 scales, the non-zero level count, ||e'||^2 and the bytes that crossed."""

    levels: np.ndarray
    scales: np.ndarray
    nnz: int
    err_sq: float
    transferred_bytes: int


def quantize_device(
    g: DeviceFlat,
    residual: torch.Tensor | None,
    bits: int,
    bucket_size: int,
    seed: int,
    rounding: str = "stochastic",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel, results left on the device: (packed levels uint8 in the wire's
    ``bitpack`` layout, scales f32, per-bucket non-zero counts i32, per-bucket ||e'||^2 f64).
    ``residual`` (float32, g's size, same device) becomes the new residual in place (under
    dither it is added in once and emptied, as ``dither.dither_core_ef``). ``rounding`` is a
    kernel rounding (rounding.ROUNDINGS: a ConfigError otherwise); ``seed`` feeds
    stochastic and dither (whose receiver needs its low 32 bits)."""
    nearest, dither = is_nearest(rounding), is_dither(rounding)
    if not 1 <= bucket_size <= MAX_DEVICE_BUCKET:
        raise ValueError(f"the Triton quantizer takes buckets of 1..{MAX_DEVICE_BUCKET}, got {bucket_size}")
    n, dev = g.size, g.tensor.device
    lmax = levels_max(bits)
    nb = n_buckets(n, bucket_size)
    nbytes = packed_bytes(n, bits)
    scales = torch.empty(nb, dtype=torch.float32, device=dev)
    nnz = torch.empty(nb, dtype=torch.int32, device=dev)
    err_sq = torch.zeros(nb, dtype=torch.float64, device=dev)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    block = max(8, triton.next_power_of_2(bucket_size))
    fuse_pack = bucket_size % 8 == 0  # a bucket then owns whole groups of 8 levels = `bits` bytes
    levels = packed if fuse_pack else torch.empty(n, dtype=torch.int8, device=dev)
    use_e = residual is not None
    K._quantize_kernel[(nb,)](
        g.tensor,
        residual if use_e else g.tensor,
        scales,
        levels,
        nnz,
        err_sq,
        _table(dev),
        n,
        bucket_size,
        seed & 0xFFFFFFFF,
        lmax,
        float(inverse_levels_max(bits)),
        nbytes,
        BLOCK=block,
        USE_E=use_e,
        PACK_BITS=bits if fuse_pack else 0,
        NEAREST=nearest,
        DITHER=dither,
        **_EXACT,
    )
    if not fuse_pack:
        packed = pack_levels(levels, bits)
    return packed, scales, nnz, err_sq


def quantize(
    g: DeviceFlat,
    residual: torch.Tensor | None,
    bits: int,
    bucket_size: int,
    seed: int,
    rounding: str = "stochastic",
) -> DeviceQuantized:
    """Quantize on the device; bring the packed levels and the scales to the host as records
    need them. g must be finite (the caller checked ``sum_squares``)."""
    packed, scales, nnz, err_sq = quantize_device(g, residual, bits, bucket_size, seed, rounding)
    host_packed = packed.cpu().numpy()
    syms = np.empty(g.size, dtype=np.uint8)
    lmax = levels_max(bits)
    if unpack_fixed(host_packed, bits, 2 * lmax, syms) < 0:  # the kernel's own output: a bug
        raise CodecError("device quantizer produced a level outside the grid", field="levels")
    levels = (syms - np.uint8(lmax)).view(np.int8)
    return DeviceQuantized(
        levels=levels,
        scales=scales.cpu().numpy(),
        nnz=int(nnz.sum()),
        err_sq=float(err_sq.sum()) if residual is not None else 0.0,
        transferred_bytes=int(host_packed.nbytes + 4 * scales.numel()),
    )


def pack_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 levels in [-L, L] -> the wire's ``bitpack`` body (uint8), on their device."""
    n = int(levels.numel())
    out = torch.empty(packed_bytes(n, bits), dtype=torch.uint8, device=levels.device)
    K._pack_kernel[_grid(n)](levels, out, n, levels_max(bits), out.numel(), BLOCK=_BLOCK, BITS=bits, **_EXACT)
    return out


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, bits: int, bucket_size: int, numel: int
) -> torch.Tensor:
    """The grid's ``float32(level) * (scale * (1 / L))`` from a ``bitpack`` body, on its device."""
    if packed.numel() < packed_bytes(numel, bits) or scales.numel() < n_buckets(numel, bucket_size):
        raise ValueError(f"{packed.numel()} bytes / {scales.numel()} scales too few for {numel} levels")
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    K._dequantize_kernel[_grid(numel)](
        packed,
        scales,
        out,
        numel,
        bucket_size,
        levels_max(bits),
        float(inverse_levels_max(bits)),
        BLOCK=_BLOCK,
        BITS=bits,
        **_EXACT,
    )
    return out


def mean_into(
    levels: Sequence[np.ndarray],
    scales: Sequence[np.ndarray],
    bits: Sequence[int],
    bucket_sizes: Sequence[int],
    out: torch.Tensor,
    dither_seeds: Sequence[int] | None = None,
) -> None:
    """``rank_mean.mean_dequantized_into`` on the device: the grid's rank mean of every rank's
    levels written into ``out`` (the gradient: float32, contiguous, on the device). The int8
    levels (a quarter of fp32) and the steps go up; nothing comes back. With
    ``dither_seeds`` (every rank's, in rank order) it is ``dither.mean_undithered_into``:
    each rank's uniforms are subtracted."""
    n, dev = int(out.numel()), out.device
    world = len(levels)
    if world == 0:
        raise ValueError("the mean needs at least one rank")
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("mean_into writes a float32 contiguous tensor")
    if dither_seeds is not None and len(dither_seeds) != world:
        raise ValueError(f"{len(dither_seeds)} dither seeds for {world} ranks")
    lv, st = rank_steps(levels, scales, bits, bucket_sizes, n)  # checked, and the grid's steps
    stride = max(x.size for x in st)
    steps = np.zeros((world, stride), dtype=np.float32)
    for r, x in enumerate(st):
        steps[r, : x.size] = x
    lv_dev = torch.from_numpy(np.stack(lv)).to(dev)
    st_dev = torch.from_numpy(steps).to(dev)
    bs_dev = torch.tensor(list(bucket_sizes), dtype=torch.int64).to(dev)
    seeds = [int(x) & 0xFFFFFFFF for x in dither_seeds] if dither_seeds is not None else [0] * world
    seeds_dev = torch.tensor(seeds, dtype=torch.int64).to(dev)
    K._mean_kernel[_grid(n)](
        lv_dev,
        st_dev,
        bs_dev,
        seeds_dev,
        _table(dev),
        out.view(-1),
        n,
        world,
        stride,
        BLOCK=_BLOCK,
        DITHER=dither_seeds is not None,
        **_EXACT,
    )


# --------------------------------------------------------------------------- references


def uniform_reference(seed: int, idx: np.ndarray) -> np.ndarray:
    """The device quantizer's uniforms in numpy: ``triton_kernels._uniform`` for these
    element indices, as float32 multiples of 2^-24 in [0, 1)."""
    with np.errstate(over="ignore"):
        x = np.asarray(idx, dtype=np.uint64).astype(np.uint32) * np.uint32(0x9E3779B9) + np.uint32(
            seed & 0xFFFFFFFF
        )
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return (x >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def quantize_reference(
    g: np.ndarray,
    residual: np.ndarray | None,
    bits: int,
    bucket_size: int,
    seed: int,
    rounding: str = "stochastic",
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The device quantizer in plain numpy (each operation an IEEE float32 op, as the kernel):
    (int8 levels, scales, new residual or None). The tests hold the kernel to these bits."""
    if is_dither(rounding):
        raise ValueError("dither's reference is the numba kernel: quantize_finite(..., rounding='dither')")
    nearest = is_nearest(rounding)
    x = np.asarray(g, dtype=np.float32).reshape(-1).copy()
    if residual is not None:
        with np.errstate(over="ignore"):
            x = np.clip(x + np.asarray(residual, dtype=np.float32), -F32_MAX, F32_MAX)
    n = x.size
    lmax = levels_max(bits)
    inv_l = inverse_levels_max(bits)
    levels = np.zeros(n, dtype=np.int8)
    scales = np.zeros(n_buckets(n, bucket_size), dtype=np.float32)
    e_new = x.copy()
    u_all = uniform_reference(seed, np.arange(n))
    for k in range(scales.size):
        lo, hi = k * bucket_size, min(n, (k + 1) * bucket_size)
        xb = x[lo:hi]
        m = scales_up_reference(np.abs(xb).max(keepdims=True))[0]
        scales[k] = m
        if m == 0:
            continue
        pre = TINY_PRESCALE if m < TINY_SCALE else np.float32(1.0)
        inv = np.float32(lmax) / (m * pre)
        step = m * inv_l
        t = (np.abs(xb) * pre) * inv
        if nearest:  # floor(t), plus one where its exact fraction is at least a half
            q = t.astype(np.int32)
            q = np.minimum(q + (t - q.astype(np.float32) >= np.float32(0.5)), lmax)
        else:
            q = np.minimum((t + u_all[lo:hi]).astype(np.int32), lmax)
        lv = np.where(xb >= 0, q, -q)
        levels[lo:hi] = lv
        e_new[lo:hi] = xb - lv.astype(np.float32) * step
    return levels, scales, (e_new if residual is not None else None)
