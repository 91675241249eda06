"""TailCompressor: bits chosen per layer, error feedback, the controller's noise estimate, checkpoints."""

import math

import numpy as np
import pytest
import torch

from tail_ray import ConfigError, TailCompressor, TailConfig, make_compressor
from tail_ray.compression.grid import on_scale_grid
from tail_ray.compression.quantize import levels_max
from tail_ray.compression.records import LayerRecord, QuantRecord, RawRecord
from tail_ray.compression.tail_config import DITHER_START_STEPS
from tail_ray.compression.wire import NAMES_SHARED, SCALES_16, decode_payload


def _grads(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(128, 512, generator=gen) * 1e-2,
        "fc1.bias": torch.randn(128, generator=gen) * 1e-2,
        "conv.weight": torch.randn(32, 16, 3, 3, generator=gen) * 1e-2,
    }


def test_roundtrip_any_fresh_instance_decodes_and_stats_are_complete():
    comp = TailCompressor(TailConfig(seed=1))
    grads = _grads()
    payload = comp.compress(grads)
    decoded = TailCompressor().decompress(payload)
    assert set(decoded) == set(grads)
    stats = {s.layer: s for s in comp.last_stats}
    for name, g in grads.items():
        assert decoded[name].dtype == torch.float32 and decoded[name].shape == (g.numel(),)
        s = stats[name]
        assert s.numel == g.numel() and s.raw_bytes == 4 * g.numel() and s.encoded_bytes > 0
    # Small layer: float16 (the default), within float16's rounding of the gradient.
    bias = grads["fc1.bias"].reshape(-1)
    assert torch.equal(decoded["fc1.bias"], bias.half().float())
    assert stats["fc1.bias"].bits == 16
    w = stats["fc1.weight"]
    assert w.bits in TailConfig().candidate_bits and 0 < w.density <= 1
    # The reported error is the estimate; the realised one is of the same size.
    real = float((decoded["fc1.weight"] - grads["fc1.weight"].reshape(-1)).pow(2).sum())
    real /= float(grads["fc1.weight"].pow(2).sum())
    assert 0.5 * w.rel_error < real < 2.0 * w.rel_error
    assert sum(s.encoded_bytes for s in comp.last_stats) <= len(payload)
    # Tail's scales are on the 16-bit grid, so they go as u16 (the header's SCALES_16 flag), and
    # "fc1.weight", "fc1.bias" share their prefix: the names go front-coded (NAMES_SHARED).
    assert payload[5] == SCALES_16 | NAMES_SHARED
    for rec in decode_payload(payload):
        if isinstance(rec, QuantRecord):
            assert on_scale_grid(rec.scales) and rec.scales.size > 0


def test_pinned_to_eight_bits():
    comp = make_compressor("tail", candidate_bits=(8,))
    for step in range(3):
        comp.compress(_grads(step))
        assert {s.bits for s in comp.last_stats if s.layer != "fc1.bias"} == {8}


def test_error_feedback_over_steps_sends_everything_eventually():
    # Error feedback is the nearest rounding's (dither keeps no residual: test_dither.py).
    comp = TailCompressor(TailConfig(candidate_bits=(3,), seed=3, rounding="nearest"))
    sent = torch.zeros(128 * 512, dtype=torch.float64)
    total = torch.zeros_like(sent)
    for step in range(20):
        g = _grads(step)
        sent += comp.decompress(comp.compress(g))["fc1.weight"].double()
        total += g["fc1.weight"].reshape(-1).double()
    residual = torch.from_numpy(comp.feedback.buffer("fc1.weight", sent.numel())).double()
    torch.testing.assert_close(sent + residual, total, rtol=0, atol=1e-5)
    # Without feedback the error would grow like sqrt(steps); with it (nu < 1) it stays bounded
    # by about one step's gradient: steady state ||e||^2 = nu / (1 - nu) * ||g||^2.
    assert float((sent - total).norm()) < float(g["fc1.weight"].norm()) * 1.5


def test_nonfinite_layer_goes_raw_unchanged_and_residual_is_not_polluted():
    comp = TailCompressor(TailConfig(seed=0))
    comp.compress(_grads(0))
    before = comp.feedback.buffer("fc1.weight", 128 * 512).copy()
    bad = _grads(1)
    bad["fc1.weight"][3, 7] = float("nan")
    bad["conv.weight"][0, 0, 0, 0] = float("inf")
    decoded = comp.decompress(comp.compress(bad))
    for name in ("fc1.weight", "conv.weight"):
        got, want = decoded[name], bad[name].reshape(-1)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        fin = torch.isfinite(want)
        assert torch.equal(got[fin], want[fin]) and torch.equal(got[~fin].isinf(), want[~fin].isinf())
    stats = {s.layer: s for s in comp.last_stats}
    assert stats["fc1.weight"].bits == 32 and stats["fc1.weight"].code == "raw"
    np.testing.assert_array_equal(comp.feedback.buffer("fc1.weight", 128 * 512), before)
    # The next finite step quantizes again.
    comp.compress(_grads(2))
    assert {s.layer: s for s in comp.last_stats}["fc1.weight"].bits != 32


def test_input_gradients_are_not_modified():
    grads = _grads(4)
    copies = {k: v.clone() for k, v in grads.items()}
    comp = TailCompressor()
    for _ in range(2):
        comp.compress(grads)
    for k in grads:
        assert torch.equal(grads[k], copies[k])


def test_state_dict_roundtrip_and_resize_choice():
    comp = TailCompressor(TailConfig(seed=5, rounding="nearest"))  # the quantizer's residuals too
    for step in range(3):
        comp.compress(_grads(step))
    state = comp.state_dict()
    # Small layers carry float16's rounding in a residual too.
    assert set(state["residuals"]) == {"fc1.weight", "conv.weight", "fc1.bias"}
    restored = TailCompressor(TailConfig(seed=5, rounding="nearest"))
    restored.load_state_dict(state)
    assert restored.controller.plans == comp.controller.plans
    assert restored.step == comp.step == 3
    np.testing.assert_array_equal(
        restored.feedback.buffer("fc1.weight", 128 * 512), comp.feedback.buffer("fc1.weight", 128 * 512)
    )
    resized = TailCompressor()
    resized.load_state_dict(state, residuals=False)
    assert resized.feedback.names() == [] and resized.controller.plans == comp.controller.plans


def _exact_records(peers: list[dict[str, torch.Tensor]]) -> list[dict[str, LayerRecord]]:
    """Each rank's gradients as raw records: what ``aggregate`` hands ``observe_peers``, here
    without compression noise (so the spread is exactly the one made up by the test)."""
    return [{n: RawRecord(n, t.reshape(-1).numpy()) for n, t in p.items()} for p in peers]


def _exchange(comps: list[TailCompressor], grads: list[dict[str, torch.Tensor]]) -> None:
    """One exchange as the collective runs it: every rank compresses, then aggregates all."""
    payloads = [c.compress(g) for c, g in zip(comps, grads, strict=True)]
    for rank, c in enumerate(comps):
        c.aggregate(payloads, {n: torch.empty(t.numel()) for n, t in grads[rank].items()}, own=rank)


def test_observe_peers_sets_budget_from_between_worker_spread():
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(65536, generator=gen)
    comp = TailCompressor(TailConfig(seed=0, warmup_steps=0))
    for noise_scale, expect_r in ((0.1, 0.01), (1.0, 0.5)):
        peers = [{"w": mean + noise_scale * torch.randn(65536, generator=gen)} for _ in range(4)]
        for _ in range(30):  # let the running average settle
            comp.observe_peers(_exact_records(peers))
        r = comp.controller.policy.relative_noise("w")
        assert r is not None and r == pytest.approx(expect_r, rel=0.2)
    comp.observe_peers(_exact_records(peers[:1]))  # world size 1: nothing to learn, nothing breaks


def test_low_noise_needs_more_bits_than_high_noise():
    """The same gradient gets more bits when peers agree (low SGD noise) than when they don't."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(65536, generator=gen) * 1e-2
    chosen = {}
    for label, spread in (("quiet", 1e-4), ("noisy", 3e-2)):
        comp = TailCompressor(TailConfig(seed=0, warmup_steps=0))
        peers = [{"w": base + spread * torch.randn(65536, generator=gen)} for _ in range(2)]
        for _ in range(20):
            comp.observe_peers(_exact_records(peers))
        for _ in range(DITHER_START_STEPS + 1):  # past dither's first steps at the largest bits
            comp.compress({"w": base})
        chosen[label] = comp.last_stats[0].bits
    assert chosen["quiet"] > chosen["noisy"]


def test_config_validation_says_what_to_fix():
    with pytest.raises(ConfigError, match="candidate_bits"):
        TailConfig(candidate_bits=(1, 9))
    with pytest.raises(ConfigError, match="bucket_size"):
        TailConfig(bucket_size=0)
    with pytest.raises(ConfigError, match="tau_min"):
        TailConfig(tau_min=1.0, tau_max=0.1)
    with pytest.raises(ConfigError, match="bad settings"):
        make_compressor("tail", no_such_field=1)
    with pytest.raises(ConfigError, match="allocation must be one of"):
        TailConfig(allocation="global")
    with pytest.raises(ConfigError, match="layer_cap"):
        TailConfig(layer_cap=0.5)
    assert TailConfig(candidate_bits=(8, 2)).candidate_bits == (2, 8)


def test_allocation_auto_is_one_budget_over_the_model_only_under_dither():
    assert TailConfig().allocation == "auto"
    assert TailConfig().allocation_for() == "model"
    assert TailConfig(rounding="dither").allocation_for() == "model"
    for rounding in ("nearest", "stochastic"):
        assert TailConfig(rounding=rounding).allocation_for() == "layer"
        assert TailCompressor(TailConfig(rounding=rounding)).controller.allocation == "layer"
    assert TailConfig(bucket_choice="auto").allocation_for() == "layer"
    assert TailConfig(allocation="layer").allocation_for() == "layer"
    assert TailConfig(allocation="model", rounding="nearest").allocation_for() == "model"
    assert TailCompressor().controller.allocation == "model"
    with pytest.raises(ConfigError, match="needs allocation"):
        TailConfig(bucket_choice="auto", allocation="model")


def test_model_allocation_round_trips_and_restores_its_curves():
    """allocation="model" through the real compressor: payloads decode, bits are candidates,
    and a checkpoint carries the per-layer error curves the allocation needs."""
    comp = TailCompressor(TailConfig(seed=5, allocation="model"))
    for step in range(3):
        grads = _grads(step)
        out = TailCompressor().decompress(comp.compress(grads))
        assert set(out) == set(grads)
        assert all(s.bits in comp.config.candidate_bits for s in comp.last_stats if s.bits <= 8)
    assert set(comp.controller.curves) == {"fc1.weight", "conv.weight"}
    restored = TailCompressor(TailConfig(seed=5, allocation="model"))
    restored.load_state_dict(comp.state_dict())
    assert restored.controller.curves == comp.controller.curves


def test_levels_are_within_bits():
    from tail_ray.compression.wire import decode_payload

    comp = TailCompressor(TailConfig(seed=2))
    recs = decode_payload(comp.compress(_grads(9)))
    assert any(isinstance(rec, QuantRecord) for rec in recs)
    for rec in recs:
        if isinstance(rec, QuantRecord):
            assert np.abs(rec.levels.astype(int)).max() <= levels_max(rec.bits)
            assert math.isfinite(float(rec.scales.sum()))


@pytest.mark.parametrize("allocation", ["layer", "model"])
def test_a_wrong_plan_whose_residual_grows_is_redecided_at_once(allocation):
    """Pin a layer to an unstable 2-bit plan (nu ~ 2 > 1 under stochastic rounding): error
    feedback would then grow the residual without bound; the compressor notices from the
    residual and decides again."""
    comp = TailCompressor(
        TailConfig(
            seed=0,
            warmup_steps=0,
            redecide_every_steps=1000,
            rounding="stochastic",
            allocation=allocation,
        )
    )
    g = _grads(0)
    comp.compress(g)
    plan = comp.controller.plans["fc1.weight"]
    plan.bits = 2  # as if the sampled estimate had been badly wrong
    if allocation == "model":  # the whole-model allocation hands out the layer's bits each step
        comp.controller._allocated["fc1.weight"] = 2
    decisions = comp.controller.decisions
    for step in range(1, 9):
        comp.compress(_grads(step))
    assert comp.controller.decisions > decisions
    assert comp.controller.plans["fc1.weight"].bits > 2
    e = comp.feedback.buffer("fc1.weight", 128 * 512)
    assert float(np.sum(e.astype(np.float64) ** 2)) < 8 * float(g["fc1.weight"].pow(2).sum())


def test_noise_estimate_is_not_fooled_by_compression_and_residuals():
    """Two workers with IDENTICAL gradients: all the spread of their decoded gradients comes
    from compression (independent rounding, different residuals); the SGD-noise estimate
    must stay near 0 instead of reading that spread as noise."""
    gen = torch.Generator().manual_seed(3)
    comps = [TailCompressor(TailConfig(seed=s, candidate_bits=(3,))) for s in (1, 2)]
    for _ in range(30):
        g = {"w": torch.randn(65536, generator=gen) * 1e-2}
        _exchange(comps, [g, g])
    r = comps[0].controller.policy.relative_noise("w")
    assert r is not None and r < 0.1  # uncorrected, it would read ~0.7 (nu + residual ~ 0.3 + 0.4)


def test_default_budget_keeps_compression_noise_a_quarter_of_sgd_noise():
    """Workers whose gradients are pure mini-batch noise (r ~ 1): the rule for the quantizer
    with error feedback (nearest) allows compression noise of at most ~1/4 of it, so the chosen
    bits' estimated error is <= ~0.25 (Gaussian buckets of 512: nu_2 ~ 1.3 does not fit, nu_3
    ~ 0.21 does). Dither's budget: tests/bitwidth/test_policy.py."""
    gen = torch.Generator().manual_seed(4)
    comps = [TailCompressor(TailConfig(seed=s, warmup_steps=0, rounding="nearest")) for s in (1, 2)]
    for _ in range(30):
        _exchange(comps, [{"w": torch.randn(65536, generator=gen)} for _ in comps])
    r = comps[0].controller.policy.relative_noise("w")
    assert r is not None and r == pytest.approx(1.0, abs=0.15)
    comps[0].compress({"w": torch.randn(65536, generator=gen)})
    stats = comps[0].last_stats[0]
    tau = comps[0].controller.policy.tau("w", comps[0].step)
    assert tau == pytest.approx(0.25 * r)
    assert stats.rel_error <= tau
    assert stats.bits == 3  # the smallest that fits: 2 bits (nu ~ 1.3) is far over budget
