"""Whole-model bit allocation: within budget, cheapest layers first, deterministic."""

import itertools
from itertools import pairwise

import numpy as np
import pytest
from budget_support import budget_settings

from tail_ray.bitwidth.allocate import (
    LayerCurve,
    ModelAllocator,
    allocate_bits,
    allowed,
    budget_used,
    pick_bits,
    trade_layers,
)
from tail_ray.bitwidth.plan import REALLOCATE_EVERY_STEPS, BitController, LayerPlan
from tail_ray.bitwidth.policy import BudgetPolicy

BITS = (2, 3, 4, 5, 6, 8)
CAP = 2.0
TAU_MAX = 0.5


def _curve(name, numel, tau, nu4, rng=None):
    """A realistic nu curve: ~5.4x per bit down from 4 bits (stochastic rounding, L = 2^(b-1) - 1)."""
    levels = np.array([2 ** (b - 1) - 1 for b in BITS], dtype=float)
    nu = nu4 * (7.0 / levels) ** 2
    if rng is not None:
        nu *= rng.uniform(0.8, 1.25, size=nu.size)
        nu = np.maximum.accumulate(nu[::-1])[::-1]  # still non-increasing in bits
    return LayerCurve(name, int(numel), float(tau), tuple(float(v) for v in nu))


def _random_model(rng, n_layers):
    return [
        _curve(
            f"layer{i}",
            rng.integers(4096, 1 << 20),
            rng.uniform(0.02, 0.5),
            rng.uniform(0.01, 0.2),
            rng,
        )
        for i in range(n_layers)
    ]


def _bits_total(curves, choice):
    return sum(c.numel * choice[c.name] for c in curves)


def test_allocation_meets_the_whole_model_budget_and_every_layer_cap():
    rng = np.random.default_rng(0)
    for _ in range(200):
        curves = _random_model(rng, int(rng.integers(1, 12)))
        choice = allocate_bits(curves, BITS, layer_cap=CAP, tau_max=TAU_MAX)
        assert set(choice) == {c.name for c in curves}
        assert budget_used(trade_layers(curves, BITS), choice, BITS) <= 1 + 1e-9
        for c in curves:
            j = BITS.index(choice[c.name])
            assert j == len(BITS) - 1 or c.nu[j] <= min(TAU_MAX, CAP * c.tau)


def test_allocation_never_sends_more_than_the_per_layer_rule_and_uses_its_slack():
    rng = np.random.default_rng(1)
    saved = []
    for _ in range(200):
        curves = _random_model(rng, 8)
        choice = allocate_bits(curves, BITS, layer_cap=CAP, tau_max=TAU_MAX)
        per_layer = {c.name: pick_bits(np.asarray(c.nu), BITS, c.tau) for c in curves}
        assert _bits_total(curves, choice) <= _bits_total(curves, per_layer)
        saved.append(1 - _bits_total(curves, choice) / _bits_total(curves, per_layer))
    # The per-layer rule leaves most of each layer's budget unspent (one bit is ~5x in nu):
    # pooling it must save bits on typical models, not only in contrived cases.
    assert np.mean(saved) > 0.05


def test_cheap_layer_gives_up_bits_first():
    # Same size and budget; at 3 bits "flat" spends 1.2x its share, "steep" 1.5x. Both fit
    # their own tau only at 4 bits (the per-layer rule gives 4 / 4); the pooled budget (2
    # shares) pays for one of them at 3 bits: the cheaper one.
    tau = 0.2
    flat = LayerCurve("flat", 10_000, tau, (0.9, 0.24, 0.05, 0.01, 0.003, 0.0002))
    steep = LayerCurve("steep", 10_000, tau, (0.9, 0.30, 0.05, 0.01, 0.003, 0.0002))
    choice = allocate_bits([steep, flat], BITS, layer_cap=CAP, tau_max=TAU_MAX)
    assert choice == {"flat": 3, "steep": 4}
    assert pick_bits(np.asarray(flat.nu), BITS, tau) == 4


def test_a_bigger_layer_weighs_more_in_the_budget_not_in_the_price():
    # The price of a bit is per element: the small layer with the flatter curve goes first
    # even though the big layer would save more bytes in one move.
    tau = 0.2
    small = LayerCurve("small", 8_192, tau, (0.9, 0.22, 0.05, 0.01, 0.003, 0.0002))
    big = LayerCurve("big", 800_000, tau, (0.9, 0.30, 0.05, 0.01, 0.003, 0.0002))
    choice = allocate_bits([small, big], BITS, layer_cap=CAP, tau_max=TAU_MAX)
    assert choice["small"] == 3 and choice["big"] == 4


def test_allocation_is_deterministic_and_independent_of_layer_order():
    rng = np.random.default_rng(2)
    for _ in range(50):
        curves = _random_model(rng, 10)
        want = allocate_bits(curves, BITS, layer_cap=CAP, tau_max=TAU_MAX)
        for perm in (curves[::-1], list(rng.permutation(curves))):
            assert allocate_bits(perm, BITS, layer_cap=CAP, tau_max=TAU_MAX) == want


def test_greedy_is_close_to_the_exhaustive_optimum():
    """Brute force over every combination on small models: the greedy (hull walk, with the
    per-layer rule as a floor) is never worse than the optimum by more than a few percent."""
    rng = np.random.default_rng(3)
    gaps = []
    for _ in range(60):
        curves = _random_model(rng, 4)
        trade = trade_layers(curves, BITS)
        choice = allocate_bits(curves, BITS, layer_cap=CAP, tau_max=TAU_MAX)
        options = [
            [BITS[j] for j in allowed(c, BITS, layer_cap=CAP, tau_max=TAU_MAX)] if c in trade else [BITS[-1]]
            for c in curves
        ]
        best = None
        for combo in itertools.product(*options):
            cand = {c.name: b for c, b in zip(curves, combo, strict=True)}
            if budget_used(trade, cand, BITS) <= 1 + 1e-12:
                total = _bits_total(curves, cand)
                best = total if best is None else min(best, total)
        assert best is not None
        assert _bits_total(curves, choice) >= best  # the optimum is a lower bound
        gaps.append(_bits_total(curves, choice) / best - 1)
    assert max(gaps) < 0.1 and np.mean(gaps) < 0.02


def test_a_layer_over_its_tau_at_every_width_keeps_the_largest_and_costs_nothing():
    tau = 0.2
    hopeless = LayerCurve("hopeless", 50_000, 1e-5, (0.9, 0.3, 0.05, 0.01, 0.003, 0.0002))
    flat = LayerCurve("flat", 10_000, tau, (0.9, 0.24, 0.05, 0.01, 0.003, 0.0002))
    steep = LayerCurve("steep", 10_000, tau, (0.9, 0.30, 0.05, 0.01, 0.003, 0.0002))
    choice = allocate_bits([hopeless, flat, steep], BITS, layer_cap=CAP, tau_max=TAU_MAX)
    assert choice == {"hopeless": 8, "flat": 3, "steep": 4}


def test_tighter_budget_in_a_critical_phase_never_uses_fewer_bits():
    rng = np.random.default_rng(4)
    for _ in range(50):
        curves = _random_model(rng, 8)
        tight = [LayerCurve(c.name, c.numel, c.tau / 2, c.nu) for c in curves]
        loose = allocate_bits(curves, BITS, layer_cap=CAP, tau_max=TAU_MAX)
        strict = allocate_bits(tight, BITS, layer_cap=CAP, tau_max=TAU_MAX)
        assert _bits_total(curves, strict) >= _bits_total(curves, loose)


def test_the_allocator_that_keeps_layer_terms_gives_what_a_fresh_allocation_gives():
    """ModelAllocator reuses an unchanged curve's terms; curves replaced, layers appearing,
    disappearing or pinned (over their tau at 8 bits) between calls must not leave stale terms."""
    rng = np.random.default_rng(4)
    kept = ModelAllocator(BITS, layer_cap=CAP, tau_max=TAU_MAX)
    curves = {c.name: c for c in _random_model(rng, 8)}
    for step in range(150):
        name = f"layer{int(rng.integers(0, 10))}"
        match step % 5:
            case 0:
                curves.pop(name, None)
            case 1:
                curves[name] = _curve(name, 4096, 1e-7, 0.05)  # pinned at the largest candidate
            case _:
                curves[name] = _curve(
                    name, rng.integers(4096, 1 << 20), rng.uniform(0.02, 0.5), rng.uniform(0.01, 0.2), rng
                )
        got = kept.allocate(curves.values())
        assert got == allocate_bits(list(curves.values()), BITS, layer_cap=CAP, tau_max=TAU_MAX)
        assert list(got) == list(allocate_bits(curves.values(), BITS, layer_cap=CAP, tau_max=TAU_MAX))


def _settings():
    return budget_settings(noise_fraction=0.25)


def _controller(allocation, **over):
    return BitController(
        BudgetPolicy(_settings()),
        candidate_bits=BITS,
        bucket_size=512,
        sample_numel=4096,
        redecide_every_steps=5,
        norm_drift=1.0,
        seed=7,
        allocation=allocation,
        **over,
    )


def _layers(rng):
    # Heavy and light tails: their nu curves differ, so their prices differ.
    return {
        f"l{i}": (rng.standard_t(df, size=n) * scale).astype(np.float32)
        for i, (df, n, scale) in enumerate(
            [(3, 1 << 15, 1.0), (30, 1 << 16, 0.01), (5, 1 << 14, 3.0), (50, 1 << 15, 1.0)]
        )
    }


def test_model_allocation_in_the_controller_saves_bits_and_is_the_same_on_every_rank():
    """Two controllers fed the same statistics (as two ranks with the same seed) agree on every
    layer's bits at every step; against the per-layer rule they send fewer bits."""
    rng = np.random.default_rng(5)
    grads = [_layers(rng) for _ in range(12)]
    ranks = [_controller("model"), _controller("model")]
    per_layer = _controller("layer")
    model_bits = layer_bits = 0
    for step, layers in enumerate(grads):
        for name, g in layers.items():
            norm = float(np.linalg.norm(g))
            a, b = (ctl.plan(name, g, None, step, norm) for ctl in ranks)
            assert a.bits == b.bits
            ref = per_layer.plan(name, g, None, step, norm)
            model_bits += a.bits * g.size
            layer_bits += ref.bits * g.size
            nu = ranks[0].curves[name].nu
            assert a.rel_error == pytest.approx(nu[BITS.index(a.bits)])
    assert model_bits < layer_bits
    # The restored controller allocates from the checkpointed curves, re-estimating nothing.
    restored = _controller("model")
    restored.load_state_dict(ranks[0].state_dict())
    want = allocate_bits(ranks[0].curves.values(), BITS, layer_cap=CAP, tau_max=TAU_MAX)
    step = len(grads) - 1
    decisions = restored.decisions
    for name, g in grads[-1].items():
        assert restored.plan(name, g, None, step, float(np.linalg.norm(g))).bits == want[name]
    assert restored.decisions == decisions


def _counting_allocations(monkeypatch, ctl):
    """The steps at which ``ctl`` allocates from now on (read ``clock[0]`` as the step)."""
    steps: list[int] = []
    clock = [0]
    allocate = ctl._allocator.allocate

    def counting(*args, **kwargs):
        steps.append(clock[0])
        return allocate(*args, **kwargs)

    monkeypatch.setattr(ctl._allocator, "allocate", counting)
    return steps, clock


def _staggered_steps(ctl, layers, steps, *, lr=lambda step: 1.0, clock=None):
    """Layers first seen one step apart, so their periodic re-estimates fall on different
    steps (as in training, where drift spreads them): some layer re-estimates on most steps."""
    names = list(layers)
    for step in steps:
        if clock is not None:
            clock[0] = step
        ctl.policy.set_lr(lr(step), step)
        for name in names[: step + 1]:
            g = layers[name]
            ctl.plan(name, g, None, step, float(np.linalg.norm(g)))


def test_model_allocation_is_redone_at_most_every_few_steps(monkeypatch):
    """Re-estimates on many steps cost an allocation at most every REALLOCATE_EVERY_STEPS
    steps, except that a layer the runaway guard invalidated is re-allocated at once (its old
    bits may be what ran away)."""
    ctl = _controller("model")
    every = ctl.reallocate_every_steps
    assert every == REALLOCATE_EVERY_STEPS > 1
    layers = _layers(np.random.default_rng(6))
    _staggered_steps(ctl, layers, range(len(layers)))  # every layer seen and allocated
    assert set(ctl._allocated) == set(layers)
    steps, clock = _counting_allocations(monkeypatch, ctl)
    invalidated: set[int] = set()
    decisions = ctl.decisions
    for step in range(len(layers), 60):
        if step % 7 == 0:
            ctl.invalidate("l1")
            invalidated.add(step)
        _staggered_steps(ctl, layers, [step], clock=clock)
    scheduled = [s for s in steps if s not in invalidated]
    assert all(b - a >= every for a, b in pairwise(scheduled))
    assert invalidated <= set(steps)  # the invalidated layer did not wait
    assert len(scheduled) >= (60 - len(layers)) // every - len(invalidated)  # the schedule runs
    assert ctl.decisions - decisions > len(steps)  # more re-estimates than allocations


def test_a_tightened_budget_is_allocated_at_once(monkeypatch):
    """Accuracy first: a critical phase (here an lr drop) halves tau, and the layers that
    re-estimate under it do not wait for the schedule: the allocation is redone that step."""
    ctl = _controller("model")
    layers = _layers(np.random.default_rng(9))
    _staggered_steps(ctl, layers, range(len(layers)))
    steps, clock = _counting_allocations(monkeypatch, ctl)
    _staggered_steps(ctl, layers, range(len(layers), 30), clock=clock)
    last = steps[-1]
    drop = last + 1  # well before the schedule's next allocation
    before = {name: ctl.curves[name].tau for name in layers}
    _staggered_steps(ctl, layers, [drop], lr=lambda step: 0.1, clock=clock)
    assert any(ctl.curves[name].tau < before[name] / 1.5 for name in layers)  # re-estimated, tighter
    assert steps[-1] == drop


def test_a_resumed_controller_reallocates_on_the_steps_the_uninterrupted_one_does():
    """The allocation may lag the latest re-estimates by a few steps: the checkpoint keeps the
    allocation in force and whether it lags, so a run resumed mid-lag sends the same bits."""
    rng = np.random.default_rng(8)
    grads = [_layers(rng) for _ in range(16)]
    whole, first = _controller("model"), _controller("model")
    resumed = None
    for step, layers in enumerate(grads):
        if step == 6:
            assert first._dirty  # saved while lagging, or the test shows nothing
            resumed = _controller("model")
            resumed.load_state_dict(first.state_dict())
        for name, g in layers.items():
            norm = float(np.linalg.norm(g)) * 2.0**step  # drifting: re-estimates on most steps
            want = whole.plan(name, g * 2.0**step, None, step, norm).bits
            ctl = first if resumed is None else resumed
            assert ctl.plan(name, g * 2.0**step, None, step, norm).bits == want, (step, name)


def test_unknown_allocation_is_refused():
    with pytest.raises(ValueError, match="allocation"):
        _controller("global")


NU = (2.0, 0.5, 0.12, 0.03, 0.008, 0.0005)  # nu at BITS: a layer that fits 4 bits at tau 0.25


def _allocated_at_step_0(ctl, *curves):
    """Curves kept and allocated as the controller would at step 0 (the first time it sees them)."""
    for c in curves:
        ctl._allocated.pop(c.name, None)
        ctl._keep_curve(c)
    ctl._allocated_plan(curves[0].name, LayerPlan(8, 0.0, 0.25, 0, 1.0), 0)
    assert not ctl._dirty and set(ctl._allocated) == {c.name for c in curves}


def test_urgency_is_judged_against_the_estimate_the_allocation_used():
    """Two re-estimates inside the lag, each 1.4x the one before, add up to 1.96x the share
    the allocation was made with: urgent, as one 1.96x re-estimate would be."""
    ctl = _controller("model")
    _allocated_at_step_0(ctl, LayerCurve("w", 1 << 15, 0.25, NU))
    ctl._keep_curve(LayerCurve("w", 1 << 15, 0.25, tuple(v * 1.4 for v in NU)))
    assert not ctl._urgent
    ctl._keep_curve(LayerCurve("w", 1 << 15, 0.25, tuple(v * 1.96 for v in NU)))
    assert ctl._urgent


def test_a_zero_tau_is_judged_without_dividing_by_it():
    """tau may be 0 (BudgetSettings(tau_min=0), no SGD noise measured): the urgency test
    multiplies out instead of dividing."""
    ctl = _controller("model")
    _allocated_at_step_0(ctl, LayerCurve("w", 1 << 15, 0.25, NU))
    ctl._keep_curve(LayerCurve("w", 1 << 15, 0.0, NU))
    assert ctl._urgent  # a budget of 0: tighter than any
    _allocated_at_step_0(ctl, LayerCurve("w", 1 << 15, 0.0, NU))
    ctl._keep_curve(LayerCurve("w", 1 << 15, 0.0, NU))
    assert not ctl._urgent


def test_a_layer_counting_steps_behind_the_allocation_does_not_wait_on_it():
    """Layers count their own steps (one that joined late runs behind). A step before the
    allocation's is due at once: the old rule (any other step) never stalled, nor may this."""
    ctl = _controller("model")
    _allocated_at_step_0(ctl, LayerCurve("a", 1 << 15, 0.25, NU), LayerCurve("b", 1 << 14, 0.25, NU))
    ctl._allocated_step = 39  # "a" allocated at its step 39, then stopped being sent
    ctl._keep_curve(LayerCurve("b", 1 << 14, 0.25, tuple(v * 1.2 for v in NU)))
    ctl._allocated_plan("b", LayerPlan(4, 0.1, 0.25, 9, 1.0), 9)  # "b" is at its step 9
    assert not ctl._dirty and ctl._allocated_step == 9


def test_a_checkpoint_resumed_under_other_allocation_settings_allocates_afresh():
    """The allocation in force is restored only under the settings it was made with: a
    resume at another layer_cap (or tau_max, or candidates) re-allocates at once."""
    saved = _controller("model")
    _allocated_at_step_0(saved, LayerCurve("a", 1 << 15, 0.25, NU), LayerCurve("b", 1 << 14, 0.1, NU))
    state = saved.state_dict()
    same = _controller("model")
    same.load_state_dict(state)
    assert same._allocated == saved._allocated and not same._dirty
    other = _controller("model", layer_cap=1.0)
    other.load_state_dict(state)
    assert other._allocated == {} and other._dirty  # allocated at the first plan call
