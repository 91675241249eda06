"""One L, one reference dequantizer, one rank mean (tail_ray/compression/grid.py), and every
kernel against them bit for bit: on this CPU, on huge and subnormal values, and with numba
compiling for other CPUs (generic x86-64, AVX2 + FMA) in subprocesses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.aggregate import mean_records_into, mean_tensors_into
from tail_ray.compression.dense_codes import pack_width
from tail_ray.compression.feedback import ErrorFeedback
from tail_ray.compression.fixedsum import LANES, sum_squares, sum_squares_reference
from tail_ray.compression.grid import (
    MAX_SCALE,
    MAX_SCALE_BITS,
    bucket_steps,
    dequantize_reference,
    levels_max,
    mean_reference,
    on_scale_grid,
    scales_up_reference,
)
from tail_ray.compression.qsgd import QSGDCompressor, QSGDConfig
from tail_ray.compression.quantize import dequantize, n_buckets, quantize, quantize_finite
from tail_ray.compression.rank_mean import mean_dequantized_into, mean_into
from tail_ray.compression.record_tensors import records_to_flat, sample_flat, sample_stack
from tail_ray.compression.records import QuantRecord, RawRecord, SparseRecord
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.topk import TopKCompressor, TopKConfig
from tests.compression.scale_edges import edge_max_abs

F32_MAX = np.float32(np.finfo(np.float32).max)
SUBNORMAL = np.float32(1e-40)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def _awkward_scales(nb: int, rng: np.random.Generator) -> np.ndarray:
    """Ordinary scales plus the extremes: float32's max, huge, subnormal, the smallest, zero."""
    sc = rng.random(nb).astype(np.float32)
    extremes = np.array([F32_MAX, 3e38, 1e38, SUBNORMAL, np.float32(1.4e-45), 0.0], np.float32)
    sc[: min(nb, extremes.size)] = extremes[: min(nb, extremes.size)]
    return sc


def _awkward_gradient(n: int, rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    x[:5] = (F32_MAX, -F32_MAX, 3e38, -1e38, 0.0)  # huge bucket
    x[600:700] = rng.standard_normal(100).astype(np.float32) * SUBNORMAL  # subnormal bucket (512..1023)
    x[512:600] = 0.0
    return x


def test_levels_max_is_the_one_l_and_the_codec_uses_it():
    assert [levels_max(b) for b in range(2, 9)] == [1, 3, 7, 15, 31, 63, 127]
    assert [pack_width(b) for b in range(2, 9)] == list(range(2, 9))
    for bad in (0, 1, 9):
        with pytest.raises(ValueError, match="bits"):
            levels_max(bad)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("bucket", [1, 7, 100, 512, 1000])
def test_dequantize_equals_the_reference_bit_for_bit(bits, bucket):
    """Lengths that leave scalar tails, buckets too short to vectorize, extreme scales: the
    places where a fastmath kernel used to reassociate level * (s * (1/L)) into (level * s) * (1/L)."""
    rng = np.random.default_rng(bits * 1000 + bucket)
    n = 10_007
    lmax = levels_max(bits)
    lv = rng.integers(-lmax, lmax + 1, n).astype(np.int8)
    lv[:6] = lmax
    sc = _awkward_scales(n_buckets(n, bucket), rng)
    want = dequantize_reference(lv, sc, bits, bucket)
    got = dequantize(lv, sc, bits, bucket)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert np.all(np.isfinite(got))
    # L * step stays finite even at float32's max: s * (1/L), never s / L (which overflows).
    assert np.all(np.abs(got[:bucket]) <= F32_MAX)


def test_every_decoding_path_equals_the_reference():
    rng = np.random.default_rng(3)
    n = 9_001
    recs = [
        QuantRecord(
            "w",
            bits=b,
            bucket_size=bs,
            scales=_awkward_scales(n_buckets(n, bs), rng),
            levels=rng.integers(-levels_max(b), levels_max(b) + 1, n).astype(np.int8),
        )
        for b, bs in ((3, 512), (8, 100), (2, 7))
    ]
    refs = [dequantize_reference(r.levels, r.scales, r.bits, r.bucket_size) for r in recs]
    for rec, ref in zip(recs, refs, strict=True):
        np.testing.assert_array_equal(_bits(records_to_flat([rec])["w"].numpy()), _bits(ref))
        for stride in (1, 5):
            np.testing.assert_array_equal(_bits(sample_flat(rec, stride).numpy()), _bits(ref[::stride]))
    for stride in (1, 3, 64):  # the controller's sampled view of every rank (numba path)
        want = np.stack([r[::stride].astype(np.float64) for r in refs])
        np.testing.assert_array_equal(sample_stack(recs, stride).numpy(), want)
    same_buckets = [r for r in recs if r.bucket_size == recs[0].bucket_size] + [recs[0]]
    out = np.empty(n, np.float32)
    mean_dequantized_into(
        [r.levels for r in same_buckets],
        [r.scales for r in same_buckets],
        [r.bits for r in same_buckets],
        [r.bucket_size for r in same_buckets],
        out,
    )
    want_mean = mean_reference(
        [dequantize_reference(r.levels, r.scales, r.bits, r.bucket_size) for r in same_buckets]
    )
    np.testing.assert_array_equal(_bits(out), _bits(want_mean))


def test_both_averaging_sites_compute_the_grid_mean():
    """compression/aggregate.py averages decoded tensors (any compressor, and raw, sparse or
    mixed layers) and decoded records (fused for quantized layers): both must give
    ``mean_reference`` of what each rank decodes, so a layer's mean never depends on its path.
    A float32 clone / add_ / div_ differs from it in the last bit (and overflows on huge values)."""
    rng = np.random.default_rng(11)
    n = 5_003
    quant = [
        QuantRecord(
            "w", bits=b, bucket_size=512,
            scales=_awkward_scales(n_buckets(n, 512), rng),
            levels=rng.integers(-levels_max(b), levels_max(b) + 1, n).astype(np.int8),
        )
        for b in (4, 8, 3)
    ]  # fmt: skip
    raw = (rng.standard_normal(n) * 1e3).astype(np.float32)
    raw[:3] = (F32_MAX, F32_MAX, -3e38)
    mixed = [quant[0], RawRecord("w", raw), quant[2]]  # a rank sent it raw
    sparse_idx = np.sort(rng.choice(n, 50, replace=False)).astype(np.int64)
    sparse = SparseRecord("w", n, indices=sparse_idx, values=raw[:50].copy())
    for ranks in (quant, mixed, [sparse, quant[1], sparse, quant[0]]):
        want = mean_reference([records_to_flat([r])["w"].numpy() for r in ranks])
        for average in (
            lambda into, ranks=ranks: mean_records_into([{"w": r} for r in ranks], into),
            lambda into, ranks=ranks: mean_tensors_into([records_to_flat([r]) for r in ranks], into),
        ):
            for grad in (torch.empty(n), torch.empty(n, dtype=torch.float64), torch.empty(2 * n)[::2]):
                average({"w": grad})
                got = grad.to(torch.float32).contiguous().numpy()
                np.testing.assert_array_equal(_bits(got), _bits(want))
                assert bool(torch.isfinite(grad).all())


def test_the_mean_is_float64_in_rank_order_and_never_overflows():
    big = np.full(1000, F32_MAX, np.float32)
    out = np.empty(1000, np.float32)
    mean_into([big, big, big, big], out)  # a float32 sum would be inf
    np.testing.assert_array_equal(out, big)
    mixed = [big, -big, np.full(1000, 3e38, np.float32)]
    mean_into(mixed, out)
    np.testing.assert_array_equal(_bits(out), _bits(mean_reference(mixed)))
    assert np.all(np.isfinite(out))
    # Rank order matters in floating point: the reference adds from rank 0 onward.
    a, b, c = (np.array([v], np.float32) for v in (1e8, 1.0, -1e8))
    assert mean_reference([a, b, c])[0] == np.float32(((1e8 + 1.0) - 1e8) / 3)
    with pytest.raises(ValueError, match="elements"):
        mean_into([big, big[:10]], out)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_residual_is_exactly_the_input_minus_what_the_receiver_decodes(bits):
    rng = np.random.default_rng(bits)
    n = 20_003
    g = _awkward_gradient(n, rng)
    e = (rng.standard_normal(n) * 1e-4).astype(np.float32)
    e[:5] = (F32_MAX, F32_MAX, 3e38, -F32_MAX, 1.0)  # g + e overflows float32 in these
    with np.errstate(over="ignore"):
        x = np.clip(g + e, -F32_MAX, F32_MAX)  # the kernel saturates g + e
    levels = np.empty(n, np.int8)
    scales = np.empty(n_buckets(n, 512), np.float32)
    nnz, err_sq = quantize_finite(g, e, bits, 512, 9, levels, scales)
    decoded = dequantize_reference(levels, scales, bits, 512)
    np.testing.assert_array_equal(_bits(e), _bits(x - decoded))
    assert err_sq == sum_squares_reference(e) and math.isfinite(err_sq)
    assert nnz == np.count_nonzero(levels)
    # Scales are the bucket max-abs of what was quantized, rounded up onto the 16-bit scale grid
    # (clamped below float32's max: bucket 0 holds F32_MAX); its largest element hits +-L.
    max_abs = np.abs(np.pad(x, (0, scales.size * 512 - n))).reshape(-1, 512).max(1)
    np.testing.assert_array_equal(scales, scales_up_reference(max_abs))
    assert on_scale_grid(scales) and scales[:1].view(np.int32)[0] == MAX_SCALE_BITS and scales[0] < F32_MAX
    assert abs(int(levels[0])) == levels_max(bits)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest", "dither"])
def test_every_quantizer_rounds_the_scale_up_onto_the_16_bit_grid_at_its_edges(rounding):
    tops = edge_max_abs()
    g = np.repeat(tops * np.float32(0.25), 8)
    g[::8] = -tops  # the max-abs, negative: its sign must not reach the scale
    want = scales_up_reference(tops)
    grid_top = MAX_SCALE
    clamped = tops > grid_top  # float32's max and the values past the grid's largest
    assert on_scale_grid(want) and clamped.sum() == 2 and np.all(want[clamped] == grid_top)
    assert np.all(want[~clamped] >= tops[~clamped])
    normal = (tops >= np.float32(1.2e-38)) & ~clamped  # up by at most 2^-8 of the value
    assert np.all(want[normal] <= tops[normal].astype(np.float64) * (1 + 2.0**-8))  # no float32 overflow
    levels = np.empty(g.size, np.int8)
    scales = np.empty(tops.size, np.float32)
    quantize(g, 4, 8, 1, levels, scales, rounding=rounding)
    np.testing.assert_array_equal(scales, want)
    # With error feedback (g + e, e written over): the same scales.
    e = np.zeros_like(g)
    levels2 = np.empty(g.size, np.int8)
    scales2 = np.empty(tops.size, np.float32)
    quantize_finite(g, e, 4, 8, 1, levels2, scales2)
    np.testing.assert_array_equal(scales2, want)


def test_tiny_and_subnormal_buckets_round_like_any_other():
    """L / s overflows float32 for s below ~2^-121 (L = 127): such buckets used to come out as
    garbage (all-zero levels and a non-zero count near -2^31 per element, the negative density
    the dashboard showed). They are scaled up by 2^64 before rounding now."""
    rng = np.random.default_rng(5)
    for scale in (SUBNORMAL, np.float32(1e-37), np.float32(2.0**-64), np.float32(1.4e-45)):
        x = (rng.uniform(-1, 1, 4096) * scale).astype(np.float32)
        x[7] = scale
        for bits in (2, 4, 8):
            levels = np.empty(x.size, np.int8)
            scales = np.empty(n_buckets(x.size, 512), np.float32)
            nnz = quantize(x, bits, 512, 1, levels, scales)
            assert nnz == np.count_nonzero(levels) and 0 <= nnz <= x.size
            assert nnz > 0 or scale < 1e-38  # (a subnormal bucket may round to all zeros)
            # x[7] is the bucket's max-abs: at the top level once its scale is rounded up onto
            # the 16-bit grid, or one below (stochastic rounding of |x| / s * L, just under L);
            # a subnormal's scale rounds up to a multiple of 2^-134, so x[7] sits lower there.
            t = float(x[7]) / float(scales[0]) * levels_max(bits)
            assert math.floor(t - 1e-6) <= levels[7] <= math.ceil(t + 1e-6)
            assert scale < 1e-38 or levels[7] >= levels_max(bits) - 1
            steps = np.repeat(bucket_steps(scales, bits), 512).astype(np.float64)
            decoded = dequantize(levels, scales, bits, 512)
            # One grid step, plus what a subnormal step loses to rounding (L + 1 of its units).
            slack = (levels_max(bits) + 1) * 1.5e-45
            assert np.all(np.abs(decoded.astype(np.float64) - x) <= steps * (1 + 1e-6) + slack)
        nu = relative_errors(x, None, 512, (2, 4, 8), sample_numel=None, rng=np.random.default_rng(0))
        # (At the smallest subnormal every value is on the grid: nu = 0 exactly.)
        assert np.all(np.isfinite(nu)) and np.all(nu >= 0) and nu[0] >= nu[1] >= nu[2]


def test_huge_finite_gradients_stay_finite_through_every_path():
    rng = np.random.default_rng(7)
    n = 8_192
    grads = {
        "huge": torch.from_numpy(_awkward_gradient(n, rng)),
        "max": torch.full((n,), float(F32_MAX)),
        "w": torch.from_numpy(rng.standard_normal(n).astype(np.float32)),
    }
    assert math.isfinite(sum_squares(grads["max"].numpy()))
    for comp in (
        TailCompressor(TailConfig(seed=1)),  # dither: no residual
        TailCompressor(TailConfig(seed=2, candidate_bits=(8,), rounding="nearest")),
        QSGDCompressor(QSGDConfig(bits=8, seed=3, error_feedback=True)),
        TopKCompressor(TopKConfig(density=0.1)),
    ):
        for _ in range(4):  # residuals carry huge values from step to step
            payload = comp.compress(grads)
            decoded = comp.decompress(payload)
            for name, t in decoded.items():
                assert bool(torch.isfinite(t).all()), (comp.name, name)
            for s in comp.last_stats:
                assert 0.0 <= s.density <= 1.0 and math.isfinite(s.rel_error) and s.encoded_bytes > 0
            dither = isinstance(comp, TailCompressor) and comp.controller.rounding == "dither"
            assert comp.feedback is not None and (dither or comp.feedback.names())  # error feedback
            for name, e in comp.feedback.state_dict().items():
                assert bool(torch.isfinite(e).all()), (comp.name, name)
            # The rank mean of four such ranks, through the compressor's own aggregate (fused
            # for quantized layers, mean_into for sparse ones; Tail's sampled spread on the
            # way): a float32 sum would overflow, the grid's float64 one gives each value back.
            into = {name: torch.empty_like(t) for name, t in grads.items()}
            comp.aggregate([payload] * 4, into)
            for name, t in into.items():
                np.testing.assert_array_equal(_bits(t.numpy()), _bits(decoded[name].numpy()))
            assert float(into["max"].abs().max()) > 3e38
    nu = relative_errors(
        grads["max"].numpy(),
        grads["max"].numpy(),
        512,
        (2, 8),
        sample_numel=1024,
        rng=np.random.default_rng(0),
    )
    assert np.all(np.isfinite(nu))


def test_folding_a_residual_into_a_huge_gradient_saturates():
    fb = ErrorFeedback()
    fb.buffer("w", 4)[:] = F32_MAX
    g = torch.tensor([float(F32_MAX), -1.0, 0.0, -float(F32_MAX)])
    assert np.all(np.isfinite(fb.compensate("w", g.numpy())))
    fb.fold_into({"w": g})
    assert bool(torch.isfinite(g).all()) and float(g[0]) == float(F32_MAX)


@pytest.mark.parametrize("n", [0, 1, LANES - 1, LANES, LANES + 1, 10 * LANES + 17, 100_003])
def test_sum_squares_has_one_fixed_order(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32) * 1e3
    assert sum_squares(x) == sum_squares_reference(x)
    if n:
        x[n // 2] = np.nan
        assert math.isnan(sum_squares(x))
        x[n // 2] = np.inf
        assert sum_squares(x) == np.inf


def _digests_under(extra_env: dict[str, str], cache_dir: Path | None) -> subprocess.Popen[str]:
    env = dict(os.environ, **extra_env)
    if cache_dir is not None:
        env.setdefault("NUMBA_CACHE_DIR", str(cache_dir))  # numba keys its cache by CPU name
    script = Path(__file__).with_name("isa_digest.py")
    return subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# Each build another CPU could give: numba compiling for plain x86-64 (SSE2, no FMA) and for
# Haswell (AVX2 + FMA), numpy's OpenBLAS running its SSE-only kernels, whose dot products
# round differently from the AVX2 / AVX-512 ones (a norm taken with np.linalg.norm once made the
# decision digest differ between an Intel and an AMD CI machine).
OTHER_BUILDS = {
    "numba generic": ({"NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": ""}, True),
    "numba haswell": ({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}, True),
    "OpenBLAS Nehalem": ({"OPENBLAS_CORETYPE": "Nehalem"}, False),
    # torch's MKL on its AVX2 kernels and ATen without vector kernels: the low-rank path's
    # factors and random starts went through these and differed (tail_lowrank_agreed) until
    # they moved to fixed-order kernels (lowrank_kernels.py).
    "torch MKL AVX2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "default"}, False),
}


@pytest.mark.slow
def test_kernels_give_the_same_bits_when_numba_compiles_for_other_cpus(tmp_path):
    """numba compiling for plain x86-64 (SSE2, no FMA) and for Haswell (AVX2 + FMA), and
    OpenBLAS on its SSE kernels, must give the bits this host's build gives, kernel by kernel:
    quantize, error feedback, dequantize, the means, the sampled view, the controller's
    estimate and decisions, and whole Tail payloads and their decoding. The numba builds
    compile cold when the cache is empty (about a minute of CPU each on 2 cores), so they run
    side by side."""
    from isa_digest import digests

    procs = {
        build: _digests_under(env, tmp_path / "numba" if own_cache else None)
        for build, (env, own_cache) in OTHER_BUILDS.items()
    }
    native = digests()
    for build, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=540)
        assert proc.returncode == 0, stderr[-3000:]
        other = json.loads(stdout)
        assert other.keys() == native.keys()
        differ = sorted(k for k in native if native[k] != other[k])
        assert not differ, f"under {build} these kernels give other bits: {differ}"
