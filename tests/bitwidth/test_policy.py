"""The budget follows training: tighter in critical phases, looser when steady, no per-model knob."""

from tail_ray.bitwidth.policy import BudgetPolicy, BudgetSettings, Phase
from tail_ray.compression.tail import TailConfig


def _policy(**over) -> BudgetPolicy:
    return BudgetPolicy(TailConfig(**over).budget_settings())


def test_tight_in_warmup_then_loosens():
    p = _policy()
    p.observe_noise("w", 0.2)
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
    p.observe_noise("w", 0.2)
    step = 500
    p.set_lr(0.1, step)
    steady = p.tau("w", step)
    p.set_lr(0.1, step + 1)
    assert p.tau("w", step + 1) == steady  # constant lr: steady
    p.set_lr(0.01, step + 2)  # a 10x drop
    assert p.phase("w", step + 2) == Phase.LR_DROP and p.tau("w", step + 2) < steady
    q = _policy()
    q.observe_noise("w", 0.2)
    q.set_lr(0.01, 400)
    q.set_lr(0.02, 401)  # rising lr: a warm-up schedule
    assert q.phase("w", 401) == Phase.WARMUP and q.tau("w", 401) < steady
    # Slow decay (cosine-like, < 20% per step) is not a drop.
    r = _policy()
    r.set_lr(0.1, 400)
    r.set_lr(0.099, 401)
    assert r.phase("w", 401) == Phase.STEADY


def test_norm_jump_tightens_only_that_layer():
    p = _policy()
    for name in ("a", "b"):
        p.observe_noise(name, 0.2)
    for step in range(300, 330):
        p.observe_norm("a", 1.0, step)
        p.observe_norm("b", 1.0, step)
    before = p.tau("a", 330)
    assert p.observe_norm("a", 5.0, 330)
    assert not p.observe_norm("b", 1.05, 330)
    assert p.tau("a", 330) < before and p.tau("b", 330) == before
    assert p.phase("a", 330) == Phase.NORM_JUMP


def test_budget_scales_with_measured_sgd_noise_not_a_model_knob():
    p = _policy()
    p.observe_noise("quiet", 0.01)
    p.observe_noise("noisy", 0.3)
    assert p.tau("quiet", 10_000) < p.tau("noisy", 10_000)
    assert p.tau("noisy", 10_000) <= TailConfig().tau_max
    assert p.tau("unknown", 10_000) == TailConfig().tau_default


def test_state_roundtrip():
    p = _policy()
    p.set_lr(0.1, 0)
    p.set_lr(0.01, 1)
    p.observe_noise("w", 0.3)
    p.observe_norm("w", 2.0, 1)
    q = BudgetPolicy(BudgetSettings(**vars(TailConfig().budget_settings())))
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict() and q.tau("w", 5) == p.tau("w", 5)
