"""Tail's small layers (below raw_below_numel: biases, norms) as float16 (the default) or at
2..8 bits, with error feedback, instead of raw fp32 (issue 15)."""

import numpy as np
import pytest
import torch

from tail_ray import ConfigError, TailCompressor, TailConfig
from tail_ray.compression.grid import dequantize_reference, levels_max
from tail_ray.compression.records import QuantRecord, RawRecord
from tail_ray.compression.wire import decode_payload


def _grads(seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        "fc.weight": torch.from_numpy((rng.standard_normal(8192) * 0.01).astype(np.float32)),
        "fc.bias": torch.from_numpy((rng.standard_normal(128) * 0.1).astype(np.float32)),
        "norm.weight": torch.from_numpy((rng.standard_normal(512) * 0.05).astype(np.float32)),
        "head.bias": torch.from_numpy(rng.standard_normal(10).astype(np.float32)),
    }


SMALL = ("fc.bias", "norm.weight", "head.bias")


def test_small_layers_at_8_bits_with_exact_error_feedback() -> None:
    comp = TailCompressor(TailConfig(seed=3, small_layer_bits=8))
    first = _grads(0)
    records = {r.name: r for r in decode_payload(comp.compress(first))}
    for name in SMALL:
        rec = records[name]
        assert isinstance(rec, QuantRecord) and rec.bits == 8, name
        g = first[name].numpy()
        decoded = dequantize_reference(rec.levels, rec.scales, rec.bits, rec.bucket_size)
        # Within one grid step of the gradient (nearest: half a step), and the residual is
        # exactly what the receiver lost.
        assert np.abs(decoded - g).max() <= 0.5 * rec.scales.max() / levels_max(8) * (1 + 1e-6)
        assert rec.scales.max() <= np.abs(g).max() * (1 + 2.0**-8)  # max-abs, up onto the scale grid
        assert comp.feedback is not None
        np.testing.assert_array_equal(comp.feedback.buffer(name, g.size), g - decoded)
    # The next step quantizes g + e: what step 0 dropped is sent now.
    second = _grads(1)
    e0 = {n: comp.feedback.buffer(n, first[n].numel()).copy() for n in SMALL}
    records = {r.name: r for r in decode_payload(comp.compress(second))}
    for name in SMALL:
        rec = records[name]
        assert isinstance(rec, QuantRecord)
        x = second[name].numpy() + e0[name]
        decoded = dequantize_reference(rec.levels, rec.scales, rec.bits, rec.bucket_size)
        np.testing.assert_array_equal(comp.feedback.buffer(name, x.size), x - decoded)
    # The stats say what was sent: 8 bits, no controller error estimate.
    stats = {s.layer: s for s in comp.last_stats}
    assert all(stats[n].bits == 8 and stats[n].rel_error == 0.0 for n in SMALL)


@pytest.mark.parametrize(("bits", "below"), [(8, 1 / 2.5), (16, 0.55)])
def test_small_layer_bits_32_is_the_raw_tail_of_before_and_costs_more(bits: int, below: float) -> None:
    new = TailCompressor(TailConfig(seed=3, small_layer_bits=bits))
    old = TailCompressor(TailConfig(seed=3, small_layer_bits=32))
    grads = _grads(0)
    new_payload, old_payload = new.compress(grads), old.compress(grads)
    old_records = {r.name: r for r in decode_payload(old_payload)}
    for name in SMALL:
        rec = old_records[name]
        assert isinstance(rec, RawRecord)
        np.testing.assert_array_equal(rec.values, grads[name].numpy())
    # The large layer is the same bytes either way (same seed, same decisions).
    new_weight = {r.name: r for r in decode_payload(new_payload)}["fc.weight"]
    old_weight = old_records["fc.weight"]
    assert isinstance(new_weight, QuantRecord) and isinstance(old_weight, QuantRecord)
    assert new_weight.levels.tobytes() == old_weight.levels.tobytes()
    small_new = sum(s.encoded_bytes for s in new.last_stats if s.layer in SMALL)
    small_old = sum(s.encoded_bytes for s in old.last_stats if s.layer in SMALL)
    # 650 elements: 2.6 KB raw, about a quarter of that at 8 bits, half as float16
    assert small_new < below * small_old


@pytest.mark.parametrize("bits", [8, 16])
def test_a_nonfinite_small_layer_goes_raw_and_keeps_its_residual(bits: int) -> None:
    comp = TailCompressor(TailConfig(seed=3, small_layer_bits=bits))
    comp.compress(_grads(0))
    assert comp.feedback is not None
    before = comp.feedback.buffer("fc.bias", 128).copy()
    bad = _grads(1)
    bad["fc.bias"][5] = float("nan")
    records = {r.name: r for r in decode_payload(comp.compress(bad))}
    assert isinstance(records["fc.bias"], RawRecord)
    np.testing.assert_array_equal(comp.feedback.buffer("fc.bias", 128), before)


def test_small_layer_bits_is_validated() -> None:
    for bad in (1, 9, 15, 33, 8.5, "8", True):
        with pytest.raises(ConfigError, match=r"small_layer_bits must be in 2\.\.8, 16 \(fp16\) or 32"):
            TailConfig(small_layer_bits=bad)
    assert TailConfig(small_layer_bits=4).small_layer_bits == 4
    got = TailConfig(small_layer_bits=8.0).small_layer_bits  # type: ignore[arg-type]  # YAML's 8.0
    assert got == 8 and isinstance(got, int)


def test_small_layers_as_float16_carry_the_rounding_in_the_residual() -> None:
    """small_layer_bits 16, the default: g + e sent as IEEE float16, e = what float16 dropped,
    exactly; a value past float16's range sends that layer as float32 and empties its residual."""
    comp = TailCompressor(TailConfig(seed=3))
    assert comp.config.small_layer_bits == 16
    assert comp.feedback is not None
    sent_sum = {n: np.zeros(_grads(0)[n].numel(), np.float64) for n in SMALL}
    true_sum = {n: np.zeros_like(v) for n, v in sent_sum.items()}
    for step in range(4):
        grads = _grads(step)
        e_in = {n: comp.feedback.buffer(n, grads[n].numel()).copy() for n in SMALL}
        records = {r.name: r for r in decode_payload(comp.compress(grads))}
        for name in SMALL:
            rec = records[name]
            assert isinstance(rec, RawRecord) and rec.fp16, name
            x = grads[name].numpy() + e_in[name]
            np.testing.assert_array_equal(rec.values, x.astype(np.float16).astype(np.float32))
            np.testing.assert_array_equal(comp.feedback.buffer(name, x.size), x - rec.values)
            sent_sum[name] += rec.values
            true_sum[name] += grads[name].numpy()
    assert {s.layer: s.bits for s in comp.last_stats if s.layer in SMALL} == dict.fromkeys(SMALL, 16)
    # Error feedback: over steps, what was sent plus what is held equals what was given.
    for name in SMALL:
        held = comp.feedback.buffer(name, sent_sum[name].size)
        np.testing.assert_allclose(sent_sum[name] + held, true_sum[name], rtol=0, atol=1e-6)
    # Past float16's 65504: float32 for that step, nothing held back.
    big = _grads(9)
    big["fc.bias"][3] = 1e6
    records = {r.name: r for r in decode_payload(comp.compress(big))}
    rec = records["fc.bias"]
    assert isinstance(rec, RawRecord) and not rec.fp16 and rec.values[3] > 9e5
    assert not comp.feedback.buffer("fc.bias", 128).any() and comp.feedback.norm_sq("fc.bias") == 0.0
