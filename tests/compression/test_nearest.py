"""Round-to-nearest (issue 15): the kernel's levels, its exact error feedback, the error model
that follows it, and the settings that choose it."""

import numpy as np
import pytest
import torch

from tail_ray import ConfigError, TailCompressor, TailConfig
from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.quantize import (
    ROUNDINGS,
    dequantize,
    kernel_rounding,
    levels_max,
    n_buckets,
    quantize,
    quantize_ef,
)

BITS = (2, 3, 4, 5, 6, 8)


def _heavy_tailed(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_t(3, size=n) * 1e-3).astype(np.float32)


def _quant(x, bits, bucket=512, seed=1, rounding="nearest"):
    levels = np.empty(x.size, np.int8)
    scales = np.empty(n_buckets(x.size, bucket), np.float32)
    quantize(x, bits, bucket, seed, levels, scales, rounding=rounding)
    return levels, scales


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_levels_are_round_half_away_of_the_scaled_value(bits):
    x = _heavy_tailed(10_000, bits)  # not a multiple of the bucket: a short last bucket
    levels, scales = _quant(x, bits, seed=3)
    lmax = levels_max(bits)
    # Reference in float64 from the kernel's own float32 t = |x| * (L / s): +1/2 and floor
    # are exact there, so this is round-half-away of t with no rounding of its own.
    inv = np.float32(lmax) / np.repeat(scales, 512)[: x.size]
    t = (np.abs(x) * inv).astype(np.float64)
    want = np.sign(x) * np.minimum(np.floor(t + 0.5), lmax)
    np.testing.assert_array_equal(levels.astype(np.float64), want)
    # No randomness: another seed gives the same levels.
    np.testing.assert_array_equal(_quant(x, bits, seed=99)[0], levels)


def test_exact_halves_round_away_from_zero():
    # Scale 3 at 3 bits (L = 3): L / s is exactly 1, so t is x itself.
    x = np.array([3.0, 0.5, 1.5, 2.5, -0.5, -1.5, 0.49999997, -2.4999998, 0.0], np.float32)
    levels, _ = _quant(x, 3, bucket=x.size)
    np.testing.assert_array_equal(levels, [3, 1, 2, 3, -1, -2, 0, -2, 0])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_residual_is_what_the_receiver_lost_bit_for_bit(bits):
    g = _heavy_tailed(20_000, 10 + bits)
    e = _heavy_tailed(20_000, 20 + bits) * np.float32(0.3)
    compensated = g + e  # float32, as the kernel forms it
    levels = np.empty(g.size, np.int8)
    scales = np.empty(n_buckets(g.size, 512), np.float32)
    quantize_ef(g, e, bits, 512, 5, levels, scales, rounding="nearest")
    decoded = dequantize(levels, scales, bits, 512)  # the decoder takes no rounding setting
    np.testing.assert_array_equal(e, compensated - decoded)
    want, _ = _quant(compensated, bits)
    np.testing.assert_array_equal(levels, want)


def test_error_model_follows_the_rounding_and_matches_the_kernel():
    x = _heavy_tailed(32_768, 0)
    rng = np.random.default_rng(0)
    nearest = relative_errors(x, None, 512, BITS, sample_numel=None, rng=rng, rounding="nearest")
    stochastic = relative_errors(x, None, 512, BITS, sample_numel=None, rng=rng)
    x64 = x.astype(np.float64)
    for j, bits in enumerate(BITS):
        levels, scales = _quant(x, bits)
        measured = np.sum((dequantize(levels, scales, bits, 512) - x64) ** 2) / np.sum(x64**2)
        # The same error term, element by element: only the float sums' order differs.
        assert nearest[j] == pytest.approx(measured, rel=1e-4)
        # About half of stochastic's (f uniform: E min(f, 1-f)^2 = 1/12, E f(1-f) = 1/6).
        assert nearest[j] < 0.6 * stochastic[j]


def test_controller_picks_fewer_bits_for_nearest_at_the_same_budget():
    rng = np.random.default_rng(1)
    grads = {"w": torch.from_numpy((rng.standard_normal(65_536) * 1e-2).astype(np.float32))}
    picked = {}
    for rounding in ("stochastic", "nearest"):
        comp = TailCompressor(TailConfig(seed=0, rounding=rounding, sample_numel=None))
        payload = comp.compress(grads)
        picked[rounding] = comp.last_stats[0].bits
        # The wire is unchanged: a default (stochastic) instance decodes it, and the residual
        # is exactly g minus what it decoded.
        decoded = TailCompressor().decompress(payload)["w"].numpy()
        residual = comp.feedback.buffer("w", 65_536)
        np.testing.assert_array_equal(residual, grads["w"].numpy() - decoded)
    assert picked["nearest"] < picked["stochastic"], picked


def test_rounding_setting_is_validated():
    with pytest.raises(
        ConfigError, match=r"rounding must be one of \['auto', 'stochastic', 'nearest', 'dither'\]"
    ):
        TailConfig(rounding="round")
    x = _heavy_tailed(1024, 0)
    with pytest.raises(ConfigError, match="rounding must be one of"):
        _quant(x, 4, rounding="Nearest")
    with pytest.raises(ConfigError, match="rounding must be one of"):
        relative_errors(x, None, 512, BITS, sample_numel=None, rng=np.random.default_rng(0), rounding="")
    assert TailConfig().rounding == "auto"
    # "auto" is TailConfig's, resolved once: the kernels and the error model take only theirs.
    with pytest.raises(ConfigError, match=r"rounding must be one of \['stochastic', 'nearest', 'dither'\]"):
        _quant(x, 4, rounding="auto")
    assert kernel_rounding("auto") == "dither"
    assert [kernel_rounding(r) for r in ROUNDINGS] == list(ROUNDINGS)  # explicit: kept
    with pytest.raises(ConfigError, match="rounding must be one of"):
        kernel_rounding("Auto")


def test_the_low_rank_target_follows_the_rounding() -> None:
    """lowrank_target "auto": "budget" where the quantizer rounds to nearest (its residual
    at the picked bits is about half what the budget priced), "bits" under stochastic rounding
    and dither (the default: their error is the one priced): the pairings measured
    (docs/engine.md, "Nearest rounding by default", "Subtractive dither by default")."""
    assert TailConfig().lowrank_target == "auto"
    modes = ("auto", "nearest", "stochastic", "dither")
    assert [TailConfig(rounding=r).lowrank_target_for() for r in modes] == ["bits", "budget", "bits", "bits"]
    for explicit in ("bits", "budget"):
        assert TailConfig(rounding="nearest", lowrank_target=explicit).lowrank_target_for() == explicit
    assert TailCompressor(TailConfig()).lowrank.target == "bits"  # type: ignore[union-attr]
    assert TailCompressor(TailConfig(rounding="nearest")).lowrank.target == "budget"  # type: ignore[union-attr]
    assert TailCompressor(TailConfig(rounding="stochastic")).lowrank.target == "bits"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="lowrank_target must be one of"):
        TailConfig(lowrank_target="tau")
