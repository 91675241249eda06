"""Triton kernels of the device codec: the heavy per-element work on the GPU, on the CPU grid.

Imported only by ``device_codec`` once the Triton backend is chosen (never at package import:
triton is an optional extra). Every kernel computes exactly the arithmetic of
tail_ray/compression/grid.py and of the numba kernels (quantize.py, quant_error.py), operation
by operation, so that on the same input and seed-independent parts the results are the same
bits as the CPU path:

    _quantize_kernel      one program per bucket: x = sat(g + e), scale = max |x|, stochastic,
                          nearest (NEAREST) or dithered (DITHER) levels, e' = x -
                          float32(level) * step (dither: e' = 0, a residual is sent once),
                          the levels bit-packed in the wire's ``bitpack`` layout (or int8),
                          per-bucket non-zero count and ||e'||^2 partial
    _pack_kernel          int8 levels -> the ``bitpack`` body (when buckets do not align to
                          byte groups of 8 levels, the quantizer writes int8 and this packs)
    _dequantize_kernel    packed levels -> float32(level) * step (the reference dequantizer)
    _mean_kernel          the grid's rank mean of R ranks' int8 levels, into the gradient
                          (DITHER: each rank's uniforms subtracted, dither.py's decoder)
    _bucket_errors_kernel the controller's sampled estimate (quant_error._bucket_error_sums)
                          in its exact summation order: the same bits, so the same decision
    _sum_squares_kernel   per-block float64 sums of squares (the layer norm and finiteness)

Bit-exactness needs two launch-time choices, made by every wrapper here: ``enable_fp_fusion=
False`` (Triton fuses a * b + c into one FMA by default, which rounds once where the grid
rounds twice: the residual and the rounding argument would differ in the last bit) and IEEE
division (``tl.fdiv(..., ieee_rounding=True)`` in float32, where the default may be
approximate; a float64 ``/`` is div.rn.f64). ``triton_aot`` compiles every kernel for sm_90
without a GPU and checks the PTX for both.

Subtractive dither (Tail's default where rounding is "auto") draws the CPU path's very
uniforms: they are keyed by position (a hash of the seed and the bucket, then of the chunk of
1,024 inside it, picks a window of the shipped uniform table and a rotation), so any program
computes any element's draw (``_dither_uniform``), and the levels, the payload and the
receiver's mean are the numba kernels' bits. The table goes to the device once
(device_codec).

Round-to-nearest has no randomness: its levels, and so the whole payload
and residual, are the numba kernel's bit for bit. Stochastic rounding's randomness is the one
part that differs from the CPU path, by design: the numba quantizer
reads a shuffled table at offsets drawn from a splitmix64 chain that runs sequentially through
the layer's buckets, which a GPU cannot reproduce without serialising. Here every element
draws its own uniform from a counter-based hash of (seed, element index) (``_uniform``), so any
program can compute any element's draw. docs/gpu.md has the argument that it stays unbiased.
"""

# Triton kernels are typed by Triton, not mypy.
# mypy: disable-error-code="no-untyped-def,name-defined,valid-type,attr-defined"

from __future__ import annotations

import triton
import triton.language as tl

# Globals a kernel reads must be constexpr (compiled Triton refuses other globals).
F32_MAX = tl.constexpr(3.4028234663852886e38)  # grid.F32_MAX, exactly float32's max
TINY_SCALE = tl.constexpr(2.0**-64)  # grid.TINY_SCALE
TINY_PRESCALE = tl.constexpr(2.0**64)  # grid.TINY_PRESCALE
LANES = tl.constexpr(64)  # fixedsum.LANES: the lane layout of every CPU float sum
# The dither stream (kernel_parts.py, dither.py): chunk length, splitmix64's increment and
# the bucket hash's multiplier.
CHUNK = tl.constexpr(1024)
GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
BUCKET_MIX = tl.constexpr(0xD1B54A32D192ED03)
SCALE_LOW_MASK = tl.constexpr(0x7FFF)  # grid.SCALE_LOW_MASK: scales keep float32 bits 30..15
SCALE_KEEP_MASK = tl.constexpr(0x7FFF8000)  # bits 30..15
MAX_SCALE_BITS = tl.constexpr(0x7F7F8000)  # grid.MAX_SCALE_BITS
TWELFTH = tl.constexpr(0.0833333358168602)  # float32(1 / 12): quant_error._TWELFTH


@triton.jit
def _uniform(seed, idx):
    """u in [0, 1), a multiple of 2^-24, from a counter-based hash of (seed, idx) (uint32).

    idx * golden + seed, then Wellons' "lowbias32" finaliser (two multiply-xorshift rounds,
    a full-avalanche 32-bit permutation): distinct indices map to distinct words, and the
    top 24 bits are uniform to within what 2^24 draws can show.
    """
    # Every product is cast back to uint32: a literal above 2^31 may widen the multiply.
    x = (idx.to(tl.uint32) * 0x9E3779B9).to(tl.uint32) + seed.to(tl.uint32)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D).to(tl.uint32)
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B).to(tl.uint32)
    x = x ^ (x >> 16)
    return (x >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _splitmix(z):
    """kernel_parts.splitmix on uint64 (every product wraps, as numba's uint64 does)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9).to(tl.uint64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB).to(tl.uint64)
    return z ^ (z >> 31)


@triton.jit
def _dither_uniform(tab_ptr, seed, k, j, mask):
    """The dither uniform of element ``j`` of bucket ``k`` (int64 tensors) under ``seed``:
    dither._chunk_window's draw for chunk j // CHUNK, then kernel_parts.uniform on the table
    entry, each float32 operation rounded on its own, so the CPU's bits."""
    h = _splitmix(seed.to(tl.uint64) ^ ((k + 1).to(tl.uint64) * BUCKET_MIX).to(tl.uint64))
    z = _splitmix((h + ((j // CHUNK) + 1).to(tl.uint64) * GOLDEN).to(tl.uint64))
    off = (z & 0xFFFF).to(tl.int64)
    rot = (z >> 40).to(tl.float32) * (1.0 / 16777216.0)  # exact: 24 bits, times 2^-24
    t = tl.load(tab_ptr + off + j % CHUNK, mask=mask, other=0)
    u = t.to(tl.float32) * (1.0 / 65536.0) + rot
    return tl.where(u >= 1.0, u - 1.0, u)


@triton.jit
def _pack_store(sym, first_byte, byte_limit, out_ptr, GROUPS: tl.constexpr, BITS: tl.constexpr):
    """Write symbols ``sym`` (uint64, 8 * GROUPS of them, masked ones already 0) as the wire's
    ``bitpack`` body: 8 symbols fill BITS bytes, LSB first, starting at byte ``first_byte``;
    bytes at or past ``byte_limit`` are not written (the layer's last partial group)."""
    grid = tl.reshape(sym, (GROUPS, 8))
    shifts = (tl.arange(0, 8) * BITS).to(tl.uint64)
    # Disjoint bit fields: their sum is their bitwise OR.
    acc = tl.sum(grid << shifts[None, :], axis=1)
    at = first_byte + tl.arange(0, GROUPS) * BITS
    for k in tl.static_range(BITS):
        byte = ((acc >> (8 * k)) & 0xFF).to(tl.uint8)
        tl.store(out_ptr + at + k, byte, mask=(at + k) < byte_limit)


@triton.jit
def _scale_up(m):
    """A finite max-abs rounded up onto the 16-bit scale grid (kernel_parts.scale_bits_up): in
    the integer domain, so the same bits as the CPU kernels."""
    b = tl.minimum(m.to(tl.int32, bitcast=True), MAX_SCALE_BITS)  # no int32 overflow below
    return ((b + SCALE_LOW_MASK) & SCALE_KEEP_MASK).to(tl.float32, bitcast=True)


# Integer arguments that may be 1 (L at 2 bits, one rank, a bucket of 1) are not specialised:
# Triton would turn them into constants, with other types than the kernels expect.
@triton.jit
def _load_fed(g_ptr, e_ptr, offs, mask, USE_E: tl.constexpr):
    """The gradient plus its error-feedback residual (when USE_E), saturated: a huge finite
    g + e stays finite, as grid.py's CPU path does. The one place every kernel reads it."""
    x = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if USE_E:
        x = x + tl.load(e_ptr + offs, mask=mask, other=0.0)
        x = tl.minimum(tl.maximum(x, -F32_MAX), F32_MAX)
    return x


@triton.jit(do_not_specialize=["n", "bucket_size", "seed", "lmax", "packed_bytes"])
def _quantize_kernel(
    g_ptr,
    e_ptr,
    scales_ptr,
    levels_ptr,
    nnz_ptr,
    err_sq_ptr,
    tab_ptr,
    n,
    bucket_size,
    seed,
    lmax,
    inv_l,
    packed_bytes,
    BLOCK: tl.constexpr,
    USE_E: tl.constexpr,
    PACK_BITS: tl.constexpr,
    NEAREST: tl.constexpr,
    DITHER: tl.constexpr,
):
    k = tl.program_id(0)
    lo = k.to(tl.int64) * bucket_size
    local = tl.arange(0, BLOCK)
    offs = lo + local
    mask = (local < bucket_size) & (offs < n)
    x = _load_fed(g_ptr, e_ptr, offs, mask, USE_E)
    ax = tl.abs(x)
    m = _scale_up(tl.max(ax, axis=0))
    tl.store(scales_ptr + k, m)
    nonzero = m > 0.0
    safe_m = tl.where(nonzero, m, 1.0)
    pre = tl.where(safe_m < TINY_SCALE, TINY_PRESCALE, 1.0).to(tl.float32)
    inv = tl.fdiv(lmax.to(tl.float32), safe_m * pre, ieee_rounding=True)
    step = m * inv_l
    t = (ax * pre) * inv  # as the numba quantizer: each operation rounded on its own
    if DITHER:
        # dither._dither_chunk: floor((x * pre) * inv + u) on the signed value (two's
        # complement: a level 0 must keep the side u pushes it to), clamped to [-L, L].
        y = (x * pre) * inv + _dither_uniform(tab_ptr, seed, k.to(tl.int64), local.to(tl.int64), mask)
        # floor as truncation, less one where that went up (y < 0): tl.floor compiles to
        # cvt.rmi.ftz, which flushes a negative denormal y (u = 0) to -0 and floors it to 0.
        fl = y.to(tl.int32)
        fl = fl - (fl.to(tl.float32) > y).to(tl.int32)  # |y| < L + 2: fl is exact in float32
        lv = tl.minimum(tl.maximum(fl, -lmax), lmax)
        lv = tl.where(mask, tl.where(nonzero, lv, 0), 0)
        q = tl.abs(lv)
    elif NEAREST:
        # quantize._nearest_chunk: t >= 0, so truncation is floor, and t - floor(t) is exact
        # in float32 (no t + 1/2, which could carry a t just below a half up): halves away
        # from zero, the same levels as the CPU kernel on every input.
        q = t.to(tl.int32)
        q = q + ((t - q.to(tl.float32)) >= 0.5).to(tl.int32)
        q = tl.minimum(q, lmax)
    else:
        # t + u >= 0, so the truncating conversion is floor.
        q = tl.minimum((t + _uniform(seed, offs)).to(tl.int32), lmax)
    if not DITHER:
        q = tl.where(mask, tl.where(nonzero, q, 0), 0)
        lv = tl.where(x >= 0.0, q, -q)
    if USE_E and DITHER:  # dither_core_ef: the residual carried in is sent now, then empty
        tl.store(e_ptr + offs, tl.zeros_like(x), mask=mask)
        tl.store(err_sq_ptr + k, 0.0)
    elif USE_E:
        e_new = x - lv.to(tl.float32) * step
        e_new = tl.where(nonzero, e_new, x)  # an all-zero bucket keeps x (zeros) as it is
        tl.store(e_ptr + offs, e_new, mask=mask)
        e64 = e_new.to(tl.float64)
        tl.store(err_sq_ptr + k, tl.sum(tl.where(mask, e64 * e64, 0.0), axis=0))
    tl.store(nnz_ptr + k, tl.sum((q != 0).to(tl.int32), axis=0))
    if PACK_BITS == 0:
        tl.store(levels_ptr + offs, lv.to(tl.int8), mask=mask)
    else:
        sym = tl.where(mask, lv + lmax, 0).to(tl.uint64)
        # bucket_size % 8 == 0 here (the wrapper checks), so a bucket owns whole byte groups.
        _pack_store(sym, lo // 8 * PACK_BITS, packed_bytes, levels_ptr, BLOCK // 8, PACK_BITS)


@triton.jit(do_not_specialize=["n", "lmax", "packed_bytes"])
def _pack_kernel(levels_ptr, out_ptr, n, lmax, packed_bytes, BLOCK: tl.constexpr, BITS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lv = tl.load(levels_ptr + offs, mask=mask, other=0).to(tl.int32)
    sym = tl.where(mask, lv + lmax, 0).to(tl.uint64)
    _pack_store(sym, pid.to(tl.int64) * (BLOCK // 8) * BITS, packed_bytes, out_ptr, BLOCK // 8, BITS)


@triton.jit
def _unpack_levels(packed_ptr, offs, mask, lmax, BITS: tl.constexpr):
    """Levels at ``offs`` of a ``bitpack`` body (symbols may straddle two bytes)."""
    bit = offs * BITS
    at = bit // 8
    lo_b = tl.load(packed_ptr + at, mask=mask, other=0).to(tl.uint32)
    hi_b = tl.load(packed_ptr + at + 1, mask=mask & ((bit % 8) + BITS > 8), other=0).to(tl.uint32)
    word = (lo_b | (hi_b << 8)) >> (bit % 8).to(tl.uint32)
    return (word & ((1 << BITS) - 1)).to(tl.int32) - lmax


@triton.jit(do_not_specialize=["n", "bucket_size", "lmax"])
def _dequantize_kernel(
    packed_ptr, scales_ptr, out_ptr, n, bucket_size, lmax, inv_l, BLOCK: tl.constexpr, BITS: tl.constexpr
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lv = _unpack_levels(packed_ptr, offs, mask, lmax, BITS)
    step = tl.load(scales_ptr + offs // bucket_size, mask=mask, other=0.0) * inv_l
    tl.store(out_ptr + offs, lv.to(tl.float32) * step, mask=mask)


@triton.jit
def _rank_value(
    levels_ptr,
    steps_ptr,
    bucket_ptr,
    seeds_ptr,
    tab_ptr,
    r,
    n,
    steps_stride,
    offs,
    mask,
    DITHER: tl.constexpr,
):
    """Rank r's decoded float32 value at ``offs``: float32(level) * step, or under DITHER
    dither._undithered with the rank's own uniforms (0 in an all-zero bucket)."""
    bs = tl.load(bucket_ptr + r)
    k = offs // bs
    # In int64: world x n may pass 2^31.
    lv = tl.load(levels_ptr + n.to(tl.int64) * r + offs, mask=mask, other=0).to(tl.float32)
    st = tl.load(steps_ptr + steps_stride.to(tl.int64) * r + k, mask=mask, other=0.0)
    if DITHER:
        u = _dither_uniform(tab_ptr, tl.load(seeds_ptr + r), k, offs - k * bs, mask)
        # NaN stays NaN (a non-finite scale from a peer), as numba's min/max keep it:
        # Triton's default max/min would return the bound.
        v = tl.maximum((lv + (0.5 - u)) * st, -F32_MAX, propagate_nan=tl.PropagateNan.ALL)
        v = tl.minimum(v, F32_MAX, propagate_nan=tl.PropagateNan.ALL)
        return tl.where(st == 0.0, 0.0, v)
    return lv * st


@triton.jit(do_not_specialize=["n", "world", "steps_stride"])
def _mean_kernel(
    levels_ptr,
    steps_ptr,
    bucket_ptr,
    seeds_ptr,
    tab_ptr,
    out_ptr,
    n,
    world,
    steps_stride,
    BLOCK: tl.constexpr,
    DITHER: tl.constexpr,
):
    """out = float32((sum over ranks in rank order of float64(value_r)) / R), value_r as
    ``_rank_value`` decodes it."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # Rank 0's value starts the sum (not 0.0 + value: that turns -0.0 into +0.0).
    acc = _rank_value(
        levels_ptr, steps_ptr, bucket_ptr, seeds_ptr, tab_ptr, 0, n, steps_stride, offs, mask, DITHER
    ).to(tl.float64)
    for r in range(1, world):
        acc = acc + _rank_value(
            levels_ptr, steps_ptr, bucket_ptr, seeds_ptr, tab_ptr, r, n, steps_stride, offs, mask, DITHER
        ).to(tl.float64)
    # A float64 ``/`` is IEEE division on NVIDIA (div.rn.f64); Triton's ieee_rounding flag is
    # float32-only (its intrinsic fails to build for doubles).
    mean = acc / world.to(tl.float64)
    tl.store(out_ptr + offs, mean.to(tl.float32), mask=mask)


@triton.jit
def _lanes_total(lanes):
    """fixedsum.lanes_total of 64 lanes: fold the upper half onto the lower half until one
    lane is left. Each fold adds exactly two values per lane (a + b, order-free), so the bits
    are the CPU's."""
    t = tl.sum(tl.reshape(lanes, (2, 32)), axis=0)
    t = tl.sum(tl.reshape(t, (2, 16)), axis=0)
    t = tl.sum(tl.reshape(t, (2, 8)), axis=0)
    t = tl.sum(tl.reshape(t, (2, 4)), axis=0)
    t = tl.sum(tl.reshape(t, (2, 2)), axis=0)
    return tl.sum(t, axis=0)


@triton.jit(do_not_specialize=["n_ids", "n", "bucket_size"])
def _bucket_errors_kernel(
    g_ptr,
    e_ptr,
    ids_ptr,
    n_ids,
    n,
    bucket_size,
    lmax_ptr,
    out_ptr,
    USE_E: tl.constexpr,
    NC: tl.constexpr,
    NC_POW2: tl.constexpr,
    NEAREST: tl.constexpr,
    DITHER: tl.constexpr,
):
    """quant_error._bucket_error_sums on the chosen buckets, in one program and in its order.

    out[0:NC] = sum over buckets of (s / L_j)^2 * (fixed-lane float32 sum of f (1 - f), of
    min(f, 1 - f)^2 when NEAREST, of 1/12 when DITHER),
    out[NC] = the fixed-lane float64 sum of x^2 (lanes carried across buckets), out[NC + 1] =
    the number of non-zero buckets. One program on purpose: the CPU's sums are sequential per
    lane, and a sample is a few thousand elements.
    """
    lane = tl.arange(0, LANES)
    sq_lanes = tl.zeros([LANES], dtype=tl.float64)
    num = tl.zeros([NC_POW2], dtype=tl.float64)
    cand = tl.arange(0, NC_POW2)
    nonzero = 0
    for t in range(0, n_ids):
        lo = tl.load(ids_ptr + t) * bucket_size
        cnt = tl.minimum(n - lo, bucket_size)
        mx = tl.zeros([LANES], dtype=tl.float32)
        for r in range(0, cnt, LANES):
            o = r + lane
            msk = o < cnt
            x = _load_fed(g_ptr, e_ptr, lo + o, msk, USE_E)
            x64 = x.to(tl.float64)
            sq_lanes = sq_lanes + tl.where(msk, x64 * x64, 0.0)
            mx = tl.maximum(mx, tl.abs(x))
        m = _scale_up(tl.max(mx, axis=0))  # the scale the quantizer will send
        if m > 0.0:
            nonzero += 1
            pre = tl.where(m < TINY_SCALE, TINY_PRESCALE, 1.0).to(tl.float32)
            for j in tl.static_range(NC):
                lf = tl.load(lmax_ptr + j).to(tl.float32)
                inv = tl.fdiv(lf, m * pre, ieee_rounding=True)
                frac = tl.zeros([LANES], dtype=tl.float32)
                for r in range(0, cnt, LANES):
                    o = r + lane
                    msk = o < cnt
                    x = _load_fed(g_ptr, e_ptr, lo + o, msk, USE_E)
                    y = (tl.abs(x) * pre) * inv
                    f = y - y.to(tl.int32).to(tl.float32)
                    if DITHER:  # quant_error._frac_term: 1/12 whatever x
                        term_f = tl.full([LANES], TWELFTH, tl.float32)
                    elif NEAREST:  # min(f, 1 - f)^2
                        d = tl.minimum(f, 1.0 - f)
                        term_f = d * d
                    else:
                        term_f = f * (1.0 - f)
                    frac = frac + tl.where(msk, term_f, 0.0)
                step = m.to(tl.float64) / lf.to(tl.float64)  # float64: IEEE div.rn.f64
                term = step * step * _lanes_total(frac).to(tl.float64)
                num = num + tl.where(cand == j, term, 0.0)
    tl.store(out_ptr + cand, num, mask=cand < NC)
    tl.store(out_ptr + NC, _lanes_total(sq_lanes))
    tl.store(out_ptr + NC + 1, nonzero.to(tl.float64))


@triton.jit
def _sum_squares_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float64)
    tl.store(partial_ptr + pid, tl.sum(x * x, axis=0))
