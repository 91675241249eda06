import numpy as np
import pytest

from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.quantize import dequantize, n_buckets, quantize

BITS = (2, 3, 4, 5, 6, 8)


def _grad(n, seed, df=3):
    return (np.random.default_rng(seed).standard_t(df, size=n) * 1e-3).astype(np.float32)


def test_closed_form_matches_monte_carlo_quantization_error():
    x = _grad(32768, 0)
    exact = relative_errors(x, None, 512, BITS, sample_numel=None, rng=np.random.default_rng(0))
    for j, bits in enumerate(BITS):
        levels = np.empty(x.size, np.int8)
        scales = np.empty(n_buckets(x.size, 512), np.float32)
        errs = []
        for seed in range(5):
            quantize(x, bits, 512, seed, levels, scales)
            d = dequantize(levels, scales, bits, 512).astype(np.float64) - x
            errs.append(np.sum(d**2) / np.sum(x.astype(np.float64) ** 2))
        assert np.mean(errs) == pytest.approx(exact[j], rel=0.05)
    assert np.all(np.diff(exact) < 0)  # more bits, less error


def test_residual_is_included():
    x = _grad(8192, 1)
    e = _grad(8192, 2)
    with_e = relative_errors(x, e, 512, BITS, sample_numel=None, rng=np.random.default_rng(0))
    summed = relative_errors(x + e, None, 512, BITS, sample_numel=None, rng=np.random.default_rng(0))
    np.testing.assert_allclose(with_e, summed, rtol=1e-5)


def test_sampled_estimate_is_close_to_exact():
    x = _grad(1 << 18, 3)
    exact = relative_errors(x, None, 512, BITS, sample_numel=None, rng=np.random.default_rng(0))
    sampled = relative_errors(x, None, 512, BITS, sample_numel=4096, rng=np.random.default_rng(1))
    np.testing.assert_allclose(sampled, exact, rtol=0.35)


def test_zero_layer_has_zero_error():
    z = np.zeros(4096, np.float32)
    assert np.all(relative_errors(z, None, 512, BITS, sample_numel=None, rng=np.random.default_rng(0)) == 0)


def test_sample_grows_when_most_buckets_are_zero():
    """Dead units give whole zero rows (= zero buckets); the sample must not rest on 1-2 buckets."""
    rng = np.random.default_rng(4)
    x = _grad(1 << 17, 5)
    rows = x.reshape(-1, 512)
    rows[rng.random(rows.shape[0]) < 0.85] = 0.0  # 85 % dead rows
    exact = relative_errors(x, None, 512, BITS, sample_numel=None, rng=rng)
    errs = [
        np.max(np.abs(relative_errors(x, None, 512, BITS, sample_numel=4096, rng=rng) / exact - 1))
        for _ in range(20)
    ]
    assert np.median(errs) < 0.35
