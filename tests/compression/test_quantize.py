"""The quantizer kernel against the analytic facts of bucketed max-abs stochastic rounding."""

import numpy as np
import pytest

from tail_ray.compression.grid import dequantize_reference, mean_reference, scales_up_reference
from tail_ray.compression.quantize import dequantize, levels_max, n_buckets, quantize, quantize_ef
from tail_ray.compression.rank_mean import mean_dequantized_into, mean_into


def _heavy_tailed(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, size=n) * 1e-3).astype(np.float32)


def _quant(x: np.ndarray, bits: int, bucket: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    levels = np.empty(x.size, np.int8)
    scales = np.empty(n_buckets(x.size, bucket), np.float32)
    quantize(x, bits, bucket, seed, levels, scales)
    return levels, scales, dequantize(levels, scales, bits, bucket)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_levels_in_range_and_scales_are_bucket_max_abs_up_on_the_scale_grid(bits):
    x = _heavy_tailed(10_000, bits)  # not a multiple of the bucket: last bucket is short
    bucket = 512
    levels, scales, _ = _quant(x, bits, bucket, seed=7)
    lmax = levels_max(bits)
    assert levels.dtype == np.int8
    assert np.abs(levels.astype(np.int16)).max() <= lmax
    expected = [np.abs(x[k : k + bucket]).max() for k in range(0, x.size, bucket)]
    np.testing.assert_array_equal(scales, scales_up_reference(np.array(expected, np.float32)))
    assert np.all(scales >= np.array(expected)) and np.all(scales <= np.array(expected) * (1 + 2.0**-8))
    # The max-abs element of each bucket sits within 2^-8 of a step below +-L: it maps to +-L,
    # or (stochastic rounding) now and then to one below; +-L where its scale was on the grid.
    tops = []
    for k, s in enumerate(scales):
        j = k * bucket + int(np.argmax(np.abs(x[k * bucket : (k + 1) * bucket])))
        assert abs(int(levels[j])) in (lmax, lmax - 1) and s > 0
        assert abs(int(levels[j])) == lmax or s > expected[k]
        tops.append(abs(int(levels[j])) == lmax)
    assert np.mean(tops) > 0.5


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_decoded_error_within_analytic_bound(bits):
    """Per element |Q(x) - x| < s/L (one grid step); in expectation the squared error is
    sum (s/L)^2 f(1-f) <= sum (s/L)^2 / 4 per bucket; the realised total must stay under the
    worst-case bound and near its closed-form expectation."""
    bucket = 256
    x = _heavy_tailed(64 * bucket, 100 + bits)
    _, scales, dec = _quant(x, bits, bucket, seed=3)
    step = np.repeat(scales / levels_max(bits), bucket)[: x.size]
    err = np.abs(dec.astype(np.float64) - x)
    assert np.all(err <= step * (1 + 1e-6))
    total = float(np.sum(err**2))
    assert total <= float(np.sum(step.astype(np.float64) ** 2)) / 4 * 1.0001 + 1e-30
    y = np.abs(x.astype(np.float64)) / step
    f = y - np.floor(y)
    expected = float(np.sum(step.astype(np.float64) ** 2 * f * (1 - f)))
    # 16K independent terms: the realised sum is within a few % of its mean.
    assert total == pytest.approx(expected, rel=0.1)


def test_stochastic_rounding_is_unbiased():
    """Mean of R independent quantizations converges to x. Per element the single-shot
    variance is (s/L)^2 f(1-f), so z = (mean - x) / sqrt(var / R) is ~N(0,1) wherever the
    rounding is not a rare event (R f (1-f) >= 10; below that the count is Poisson-like and a
    Gaussian z-bound is wrong). Tolerances: every such |z| < 6, the mean of z within 4/sqrt(n),
    and the summed deviation over ALL elements within 4 of its standard deviation."""
    bits, bucket, trials = 2, 512, 1500
    x = _heavy_tailed(4096, 11)
    acc = np.zeros(x.size, np.float64)
    for t in range(trials):
        _, scales, dec = _quant(x, bits, bucket, seed=1000 + t)
        acc += dec
    mean = acc / trials
    step = np.repeat(scales.astype(np.float64) / levels_max(bits), bucket)[: x.size]
    y = np.abs(x) / step
    f = y - np.floor(y)
    var = step**2 * f * (1 - f)
    gaussian = trials * f * (1 - f) >= 10
    z = (mean[gaussian] - x[gaussian]) / np.sqrt(var[gaussian] / trials)
    assert gaussian.sum() > 3000
    assert np.abs(z).max() < 6.0
    assert abs(z.mean()) < 4.0 / np.sqrt(z.size)
    total_dev = float(np.sum(mean - x))
    assert abs(total_dev) < 4.0 * np.sqrt(float(np.sum(var)) / trials)
    # Elements exactly on the grid (the bucket maxima) are never perturbed.
    on_grid = var == 0
    np.testing.assert_allclose(mean[on_grid], x[on_grid], rtol=1e-6)


def test_error_feedback_invariant_compensated_equals_decoded_plus_residual():
    rng = np.random.default_rng(5)
    bucket, bits = 512, 3
    g_steps = [rng.standard_normal(5000).astype(np.float32) for _ in range(4)]
    e = np.zeros(5000, np.float32)
    for i, g in enumerate(g_steps):
        compensated = g + e
        levels = np.empty(g.size, np.int8)
        scales = np.empty(n_buckets(g.size, bucket), np.float32)
        nnz, sumsq = quantize_ef(g, e, bits, bucket, i, levels, scales)
        dec = dequantize(levels, scales, bits, bucket)
        np.testing.assert_allclose(dec + e, compensated, rtol=0, atol=1e-6 * np.abs(compensated).max())
        assert nnz == np.count_nonzero(levels)
        assert sumsq == pytest.approx(float(np.sum(g.astype(np.float64) ** 2)), rel=1e-9)


def test_nonfinite_input_touches_nothing():
    g = np.ones(2048, np.float32)
    g[100] = np.inf
    e = np.full(2048, 0.5, np.float32)
    levels = np.full(2048, 9, np.int8)
    scales = np.full(4, 9.0, np.float32)
    nnz, sumsq = quantize_ef(g, e, 4, 512, 0, levels, scales)
    assert nnz == -1 and not np.isfinite(sumsq)
    assert np.all(e == 0.5) and np.all(levels == 9) and np.all(scales == 9.0)
    g[100] = np.nan
    assert quantize_ef(g, e, 4, 512, 0, levels, scales)[0] == -1
    with pytest.raises(ValueError, match="finite"):
        quantize(g, 4, 512, 0, levels, scales)


def test_all_zero_and_single_element_and_huge_values():
    levels, scales, dec = _quant(np.zeros(1000, np.float32), 4, 512, 0)
    assert np.all(levels == 0) and np.all(scales == 0) and np.all(dec == 0)
    levels, scales, dec = _quant(np.array([-3.5], np.float32), 2, 512, 0)
    assert levels.tolist() == [-1] and dec.tolist() == [-3.5]
    big = np.array([3e38, -3e38, 1e38, 0.0], np.float32)
    levels, scales, dec = _quant(big, 8, 512, 0)
    assert np.all(np.isfinite(dec)) and np.all(np.abs(dec - big) <= 3e38 / 127 * 1.0001)


def test_different_seeds_give_different_roundings_same_seed_same():
    x = _heavy_tailed(4096, 2)
    a, _, _ = _quant(x, 2, 512, 1)
    b, _, _ = _quant(x, 2, 512, 1)
    c, _, _ = _quant(x, 2, 512, 2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("bucket_sizes", [(512, 512, 512), (7, 512, 1000)])
def test_fused_mean_equals_dequantize_then_reference_mean_bit_for_bit(bucket_sizes):
    """Ranks may differ in bits and even bucket size; the one-pass mean must equal dequantizing
    each and taking the grid's rank mean (float64 sum in rank order, / R, to float32)."""
    rng = np.random.default_rng(11)
    n = 50_003
    bits = (2, 5, 8)
    levels = [rng.integers(-levels_max(b), levels_max(b) + 1, n).astype(np.int8) for b in bits]
    scales = [rng.random(n_buckets(n, bs)).astype(np.float32) for bs in bucket_sizes]
    per_rank = zip(levels, scales, bits, bucket_sizes, strict=True)
    decoded = [dequantize_reference(lv, s, b, bs) for lv, s, b, bs in per_rank]
    for world in (1, 2, 3):
        want = mean_reference(decoded[:world])
        out = np.empty(n, np.float32)
        mean_dequantized_into(
            levels[:world], scales[:world], list(bits[:world]), list(bucket_sizes[:world]), out
        )
        np.testing.assert_array_equal(out.view(np.int32), want.view(np.int32))
        # The mean of already-decoded layers (raw or mixed codes) is the same arithmetic.
        out_f = np.empty(n, np.float32)
        mean_into(decoded[:world], out_f)
        np.testing.assert_array_equal(out_f.view(np.int32), want.view(np.int32))


def test_sampled_dequantization_equals_full_dequantization():
    import torch

    from tail_ray.compression.record_tensors import records_to_flat, sample_flat, sample_stack
    from tail_ray.compression.records import QuantRecord, RawRecord

    rng = np.random.default_rng(12)
    n = 70_001
    rec = QuantRecord(
        "w",
        bits=3,
        bucket_size=512,
        scales=rng.random(n_buckets(n, 512)).astype(np.float32),
        levels=rng.integers(-3, 4, n).astype(np.int8),
    )
    raw = RawRecord("r", rng.standard_normal(n).astype(np.float32))
    for r in (rec, raw):
        full = records_to_flat([r])[r.name]
        for stride in (1, 4, 17):
            np.testing.assert_array_equal(sample_flat(r, stride).numpy(), full[::stride].numpy())
    other = QuantRecord(
        "w",
        bits=6,
        bucket_size=100,
        scales=rng.random(n_buckets(n, 100)).astype(np.float32),
        levels=rng.integers(-31, 32, n).astype(np.int8),
    )
    for recs in ([rec, other], [rec, raw]):  # the numba path, and the mixed fallback
        full = torch.stack([records_to_flat([r])[r.name] for r in recs]).double()
        for stride in (1, 4, 17):
            np.testing.assert_array_equal(sample_stack(recs, stride).numpy(), full[:, ::stride].numpy())


def test_fused_mean_checks_sizes_before_the_unchecked_kernel():
    out = np.empty(1000, np.float32)
    lv = np.zeros(1000, np.int8)
    with pytest.raises(ValueError, match="levels"):
        mean_dequantized_into([lv, lv[:999]], [np.ones(2, np.float32)] * 2, [3, 3], [512, 512], out)
    with pytest.raises(ValueError, match="scales"):
        mean_dequantized_into(
            [lv, lv], [np.ones(2, np.float32), np.ones(1, np.float32)], [3, 3], [512, 512], out
        )
