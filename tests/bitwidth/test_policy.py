"""The budget follows training: tighter in critical phases, looser when steady, no per-model knob."""

import pytest

from tail_ray.bitwidth.policy import BudgetPolicy, BudgetSettings, Phase
from tail_ray.compression.tail import TailConfig
from tail_ray.errors import ConfigError


def _policy(**over) -> BudgetPolicy:
    return BudgetPolicy(TailConfig(**over).budget_settings())


def _noise(p: BudgetPolicy, name: str, r: float) -> None:
    """Feed a spread measurement whose relative SGD noise is r (no compression noise)."""
    p.observe_spread(name, r, 0.0, 1.0)


def test_tight_in_warmup_then_loosens():
    p = _policy()
    _noise(p, "w", 0.2)
    early = p.tau("w", 0)
    assert p.phase("w", 0) == Phase.WARMUP
    s = TailConfig().warmup_steps + 2 * TailConfig().critical_steps + 1
    steady = p.tau("w", s)
    assert p.phase("w", s) == Phase.STEADY
    assert early < steady
    mid = p.tau("w", TailConfig().warmup_steps + TailConfig().critical_steps // 2)
    assert early <= mid <= steady  # ramps, no cliff


def test_lr_warmup_schedule_and_lr_drop_tighten():
    p = _policy()
    _noise(p, "w", 0.2)
    step = 500
    p.set_lr(0.1, step)
    steady = p.tau("w", step)
    p.set_lr(0.1, step + 1)
    assert p.tau("w", step + 1) == steady  # constant lr: steady
    p.set_lr(0.01, step + 2)  # a 10x drop
    assert p.phase("w", step + 2) == Phase.LR_DROP and p.tau("w", step + 2) < steady
    q = _policy()
    _noise(q, "w", 0.2)
    q.set_lr(0.01, 400)
    q.set_lr(0.02, 401)  # rising lr: a warm-up schedule
    assert q.phase("w", 401) == Phase.WARMUP and q.tau("w", 401) < steady
    # Slow decay (cosine-like, < 20% per step) is not a drop.
    r = _policy()
    r.set_lr(0.1, 400)
    r.set_lr(0.099, 401)
    assert r.phase("w", 401) == Phase.STEADY


def test_norm_jump_tightens_only_that_layer_and_ignores_single_spikes():
    p = _policy()
    for name in ("a", "b"):
        _noise(p, name, 0.2)
    for step in range(300, 330):
        p.observe_norm("a", 1.0, step)
        p.observe_norm("b", 1.0, step)
    before = p.tau("a", 330)
    assert not p.observe_norm("b", 5.0, 330)  # one noisy step is not a phase change
    assert not p.observe_norm("b", 1.0, 331)
    jumped = [p.observe_norm("a", 5.0, step) for step in range(330, 334)]  # a sustained 5x move
    assert any(jumped)
    assert p.tau("a", 334) < before and p.tau("b", 334) == before
    assert p.phase("a", 334) == Phase.NORM_JUMP and p.phase("b", 334) == Phase.STEADY


def test_noise_estimate_removes_the_compression_noise_it_carries():
    p = _policy()
    # Spread 0.5 per element, of which compression explains 0.2; ||g||^2 per element 1.5.
    p.observe_spread("w", 0.5, 0.2, 1.5)
    assert p.relative_noise("w") == pytest.approx(0.2)
    p2 = _policy()
    p2.observe_spread("w", 0.1, 0.3, 1.0)  # spread below what compression alone explains
    assert p2.relative_noise("w") == 0.0
    p2.observe_spread("w", float("nan"), 0.3, 1.0)  # ignored, not poisoning the average
    assert p2.relative_noise("w") == 0.0


def test_budget_scales_with_measured_sgd_noise_not_a_model_knob():
    p = _policy()
    _noise(p, "quiet", 0.01)
    _noise(p, "noisy", 0.3)
    assert p.tau("quiet", 10_000) < p.tau("noisy", 10_000)
    assert p.tau("noisy", 10_000) <= TailConfig().tau_max
    assert p.tau("unknown", 10_000) == TailConfig().tau_default


def test_state_roundtrip():
    p = _policy()
    p.set_lr(0.1, 0)
    p.set_lr(0.01, 1)
    _noise(p, "w", 0.3)
    p.observe_norm("w", 2.0, 1)
    q = BudgetPolicy(BudgetSettings(**vars(TailConfig().budget_settings())))
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict() and q.tau("w", 5) == p.tau("w", 5)


@pytest.mark.parametrize("r", [1.0, 0.6, 0.1])
def test_default_budget_is_a_quarter_of_the_sgd_noise(r):
    # The default rule (measured on the char LM: compression noise equal to the SGD noise cost
    # +2.2-2.5 % validation loss, a quarter of it +0.2-1.3 %, mean +0.9 %): tau = r / 4 when steady,
    # for the quantizer with error feedback (nearest; dither's budget is the next test's).
    p = _policy(rounding="nearest")
    _noise(p, "w", r)
    s = TailConfig().warmup_steps + 2 * TailConfig().critical_steps + 1
    assert p.phase("w", s) == Phase.STEADY
    assert p.tau("w", s) == pytest.approx(r / 4)
    # r <= 1 by construction (spread / (signal + spread)), so the steady budget never passes 1/4,
    # which on max-abs buckets of 512 rules out 3 bits (nu_3 ~ 0.2-0.37 on real gradients) for
    # pure-noise layers unless their distribution makes 3 bits that accurate.
    assert p.tau("w", s) <= 0.25


@pytest.mark.parametrize("r", [0.9, 0.6, 0.1])
def test_a_linear_optimizer_gets_half_the_sgd_noise_and_adam_keeps_a_quarter(r):
    # SGD's step is linear in the gradient: with error feedback the compressed steps add up to
    # the true ones less lr times the residual, so it may take twice Adam's fraction (measured:
    # docs/engine.md, "The budget follows the optimizer").
    p = _policy(rounding="nearest")
    _noise(p, "w", r)
    s = TailConfig().warmup_steps + 2 * TailConfig().critical_steps + 1
    assert not p.linear and p.tau("w", s) == pytest.approx(r / 4)
    p.set_linear(True)
    assert p.linear and p.noise_fraction == TailConfig().linear_noise_fraction
    assert p.tau("w", s) == pytest.approx(min(r / 2, TailConfig().tau_max))
    assert p.tau("w", 0) == pytest.approx(r / 4)  # critical phases still halve it
    p.set_linear(False)
    assert p.tau("w", s) == pytest.approx(r / 4)
    # One budget whatever the optimizer, when asked for.
    same = _policy(rounding="nearest", linear_noise_fraction=0.25)
    same.set_linear(True)
    _noise(same, "w", r)
    assert same.tau("w", s) == pytest.approx(r / 4)


@pytest.mark.parametrize("r", [0.9, 0.1])
def test_the_default_dither_budget_is_half_the_sgd_noise_for_adam_too(r):
    # Dither's error is memoryless noise that no residual piles up: Adam's budget is
    # dither_noise_fraction (measured on the LM, docs/engine.md, "Subtractive dither by
    # default"), the linear optimizers keep theirs; "nearest" keeps its quarter.
    p = _policy()
    _noise(p, "w", r)
    s = TailConfig().warmup_steps + 2 * TailConfig().critical_steps + 1
    assert p.noise_fraction == TailConfig().dither_noise_fraction == 0.5
    assert p.tau("w", s) == pytest.approx(min(r / 2, TailConfig().tau_max))
    p.set_linear(True)
    assert p.noise_fraction == TailConfig().linear_noise_fraction
    assert _policy(rounding="nearest").noise_fraction == TailConfig().noise_fraction == 0.25
    assert _policy(dither_noise_fraction=0.3).noise_fraction == 0.3


def test_the_optimizer_kind_survives_a_checkpoint_and_old_ones_load_as_unknown():
    p = _policy()
    p.set_linear(True)
    q = _policy()
    q.load_state_dict(p.state_dict())
    assert q.linear
    old = {k: v for k, v in p.state_dict().items() if k != "linear"}  # written before the field
    q.load_state_dict(old)
    assert not q.linear


def test_a_checkpoint_does_not_overrule_the_optimizer_this_run_was_told_of():
    # An SGD run loading an Adam run's checkpoint (or one from before the field) after its first
    # step keeps the answer for the optimizer that is stepping now.
    adam = _policy()
    adam.set_linear(False)
    sgd = _policy()
    sgd.set_linear(True)
    sgd.load_state_dict(adam.state_dict())
    assert sgd.linear
    sgd.load_state_dict({k: v for k, v in adam.state_dict().items() if k != "linear"})
    assert sgd.linear
    told_adam = _policy()
    told_adam.set_linear(False)
    told_adam.load_state_dict(sgd.state_dict())
    assert not told_adam.linear


def test_linear_noise_fraction_is_validated():
    with pytest.raises(ConfigError, match="linear_noise_fraction"):
        TailConfig(linear_noise_fraction=0)
    with pytest.raises(ConfigError, match="linear_noise_fraction"):
        TailConfig(linear_noise_fraction=float("nan"))
