"""The link-aware switch's schedule and decisions, driven by scripted step times.

The gate only sees a clock reading at the start of every step; these tests hand it one per
step from a table of "how long a step takes in each mode", so every decision is known.
"""

import threading

import pytest

from tail_ray.collective.gate import LinkGate, LinkGateConfig, Mode, split_gate_settings
from tail_ray.errors import ConfigError


def identity(values):
    return list(values)


def drive(gate, step_ms, steps, agree=identity):
    """Run ``steps`` steps; a step in mode m lasts step_ms[m](step) ms. Returns the modes."""
    now = 0.0
    modes = []
    for step in range(steps):
        mode = gate.begin_step(now, agree)
        modes.append(mode)
        now += step_ms[mode](step) / 1e3
    return modes


CFG = LinkGateConfig(warmup_steps=2, trial_steps=3, recheck_every_steps=10, max_recheck_every_steps=40)


def interval(gap: float, confirmations: int) -> int:
    """The re-check interval the gate's docstring promises, for CFG."""
    return min(max(int(10 * 2**confirmations * min(gap * gap, 64)), 10), 40)


def test_fast_link_settles_on_allreduce_and_rechecks_later_each_time():
    gate = LinkGate(CFG)
    modes = drive(gate, {Mode.COMPRESS: lambda s: 50.0, Mode.ALLREDUCE: lambda s: 35.0}, 90)
    # warm-up (2) + compressed trial (3) + all-reduce trial (3), then the decision.
    assert modes[:8] == [Mode.COMPRESS] * 5 + [Mode.ALLREDUCE] * 3
    assert gate.decisions[0][:2] == (8, Mode.ALLREDUCE)
    assert gate.decisions[0][2] == pytest.approx(0.050) and gate.decisions[0][3] == pytest.approx(0.035)
    # Re-checks try compression again; 50 ms < 1.5 x 35 ms, so each is a full 3-step trial
    # that confirms all-reduce, and the next one comes twice as late (then the cap).
    assert all(d[1] == Mode.ALLREDUCE for d in gate.decisions)
    starts = [d[0] for d in gate.decisions]
    assert starts[1] - starts[0] == interval(50 / 35, 0) + 3 == 23
    assert starts[2] - starts[1] == interval(50 / 35, 1) + 3 == 43
    assert sum(m == Mode.COMPRESS for m in modes[8:]) == 3 * (len(gate.decisions) - 1)


def test_slow_link_aborts_the_allreduce_trial_after_one_step_and_rechecks_rarely():
    gate = LinkGate(CFG)
    modes = drive(gate, {Mode.COMPRESS: lambda s: 50.0, Mode.ALLREDUCE: lambda s: 1400.0}, 60)
    assert modes[:6] == [Mode.COMPRESS] * 5 + [Mode.ALLREDUCE]
    assert modes[6:46] == [Mode.COMPRESS] * 40  # a 28x gap: the longest interval at once
    assert gate.decisions[0][:2] == (6, Mode.COMPRESS)
    # One all-reduce step per re-check.
    assert modes.count(Mode.ALLREDUCE) == len(gate.decisions) == 2
    assert [d[0] for d in gate.decisions] == [6, 6 + 40 + 1]


def test_close_race_runs_the_whole_trial_and_takes_the_faster_mode():
    gate = LinkGate(CFG)
    modes = drive(gate, {Mode.COMPRESS: lambda s: 50.0, Mode.ALLREDUCE: lambda s: 55.0}, 9)
    assert modes[5:8] == [Mode.ALLREDUCE] * 3  # 55 < 1.5 x 50: no abort
    assert modes[8] == Mode.COMPRESS and gate.decisions[0][1] == Mode.COMPRESS


def test_a_compressed_recheck_much_slower_than_allreduce_stops_after_one_step():
    gate = LinkGate(CFG)
    modes = drive(gate, {Mode.COMPRESS: lambda s: 60.0, Mode.ALLREDUCE: lambda s: 35.0}, 45)
    at = 8 + interval(60 / 35, 0)
    assert modes[at] == Mode.COMPRESS and modes[at + 1] == Mode.ALLREDUCE  # 60 > 1.5 x 35
    assert [d[:2] for d in gate.decisions] == [(8, Mode.ALLREDUCE), (at + 1, Mode.ALLREDUCE)]


def test_a_link_that_gets_busy_is_noticed_before_the_recheck_interval():
    gate = LinkGate(
        LinkGateConfig(warmup_steps=2, trial_steps=3, recheck_every_steps=1000, max_recheck_every_steps=1000)
    )
    # The link gets busy at step 20: all-reduce steps go from 30 ms to 300 ms.
    modes = drive(
        gate, {Mode.COMPRESS: lambda s: 60.0, Mode.ALLREDUCE: lambda s: 30.0 if s < 20 else 300.0}, 50
    )
    assert gate.decisions[0][1] == Mode.ALLREDUCE
    assert gate.decisions[-1][1] == Mode.COMPRESS
    assert gate.decisions[-1][0] < 40  # the drift check, every 10 settled steps
    assert modes[-5:] == [Mode.COMPRESS] * 5


def test_warmup_steps_are_not_timed():
    # The first steps are slow (JIT); were they timed, compression would look 100x slower.
    gate = LinkGate(CFG)
    drive(gate, {Mode.COMPRESS: lambda s: 5000.0 if s < 2 else 40.0, Mode.ALLREDUCE: lambda s: 45.0}, 10)
    assert gate.decisions[0][1] == Mode.COMPRESS
    assert gate.decisions[0][2] == pytest.approx(0.040)


def test_disabled_gate_always_compresses_and_never_communicates():
    def agree(values):
        raise AssertionError("a disabled gate must not issue collectives")

    gate = LinkGate(LinkGateConfig(enabled=False))
    modes = drive(gate, {Mode.COMPRESS: lambda s: 100.0, Mode.ALLREDUCE: lambda s: 1.0}, 50, agree)
    assert set(modes) == {Mode.COMPRESS} and list(gate.decisions) == []


def test_ranks_with_different_timings_make_the_same_choices():
    """Each rank times its own steps; agree (here: a max over two threads) makes them match."""
    box: dict[int, list[float]] = {}
    barrier = threading.Barrier(2)

    def agree_for(rank):
        def agree(values):
            box[rank] = list(values)
            barrier.wait()
            out = [max(a, b) for a, b in zip(box[0], box[1], strict=True)]
            barrier.wait()
            return out

        return agree

    # Rank 0 alone would keep all-reduce (40 < 50); rank 1 sees all-reduce at 70 ms.
    timings = [
        {Mode.COMPRESS: lambda s: 50.0, Mode.ALLREDUCE: lambda s: 40.0},
        {Mode.COMPRESS: lambda s: 45.0, Mode.ALLREDUCE: lambda s: 70.0},
    ]
    result: dict[int, list[Mode]] = {}
    gates = [LinkGate(CFG), LinkGate(CFG)]
    threads = [
        threading.Thread(
            target=lambda r=r: result.__setitem__(r, drive(gates[r], timings[r], 60, agree_for(r)))
        )
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert result[0] == result[1]
    assert list(gates[0].decisions) == list(gates[1].decisions)
    assert gates[0].decisions[0][1] == Mode.COMPRESS  # the slowest rank's view: 70 > 50


def test_settings_split_from_the_compressor_and_validated():
    rest, cfg = split_gate_settings({"bits": 4, "link_aware": False, "link_trial_steps": 2})
    assert rest == {"bits": 4} and cfg == LinkGateConfig(enabled=False, trial_steps=2)
    with pytest.raises(ConfigError, match="link_trial_steps must be an integer >= 1"):
        split_gate_settings({"link_trial_steps": 0})
    with pytest.raises(ConfigError, match="link_aware must be true or false"):
        split_gate_settings({"link_aware": "yes"})
    with pytest.raises(ConfigError, match="link_abort_ratio"):
        split_gate_settings({"link_abort_ratio": 1.0})
    with pytest.raises(ConfigError, match="link_max_recheck_every_steps"):
        split_gate_settings({"link_recheck_every_steps": 100, "link_max_recheck_every_steps": 10})


def test_thousands_of_confirming_rechecks_neither_overflow_nor_grow_memory():
    # Re-check every step and keep confirming: 2**confirmations would overflow a float after
    # 1024 confirmations (a crash inside the DDP hook); the interval stays at its max.
    cfg = LinkGateConfig(warmup_steps=0, trial_steps=1, recheck_every_steps=1, max_recheck_every_steps=1)
    gate = LinkGate(cfg)
    modes = drive(gate, {Mode.COMPRESS: lambda s: 50.0, Mode.ALLREDUCE: lambda s: 35.0}, 4000)
    assert all(d[1] == Mode.ALLREDUCE for d in gate.decisions) and Mode.ALLREDUCE in modes[-3:]
    assert len(gate.decisions) == 256 and gate.decisions[-1][0] > 3990
