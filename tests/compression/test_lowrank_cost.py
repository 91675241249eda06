"""What the low-rank chooser's trials cost, and what keeps that cost flat (issue 15: the
decision share of compress time was 3-15 % on the LM, from a fat tail of slow trials).

Speeds are never asserted here (shared machines); the tests pin the mechanisms instead."""

from __future__ import annotations

import numpy as np
import torch

from tail_ray.bitwidth import lowrank_energy
from tail_ray.compression.tail import TailCompressor, TailConfig


def _low_rank_gradient(rows: int, cols: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    u, v = torch.randn(rows, 2, generator=gen), torch.randn(cols, 2, generator=gen)
    noise = torch.randn(rows, cols, generator=torch.Generator().manual_seed(step))
    return u @ v.T + 0.01 * noise


def _tail(**extra) -> TailCompressor:  # type: ignore[no-untyped-def]
    config = {"lowrank": "on", "warmup_steps": 0, "redecide_every_steps": 4, "seed": 7} | extra
    return TailCompressor(TailConfig(**config))


def test_every_trial_records_its_wall_and_cpu_time() -> None:
    comp = _tail()
    for step in range(6):
        comp.compress({"w": _low_rank_gradient(128, 256, step)})
    assert comp.lowrank is not None
    # Step 0 measures the quantized bytes (nothing to compare with: no trial), step 4 runs
    # the layer's one trial, and it enters.
    assert comp.lowrank.rank_of("w") > 0
    (times,) = comp.lowrank.trial_times_s
    wall_s, cpu_s = times
    assert 0 < wall_s < 60 and 0 <= cpu_s < 60


def test_a_trial_sums_its_matrix_without_numpys_blas(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """numpy's OpenBLAS threads a dot product above 10k elements; on a busy host the caller
    spun on threads that were not running (2-12 ms for a 0.5 ms trial). The trial's ||M||^2
    is the fixed-order numba sum instead: no level-1 BLAS call may run in a trial."""

    def refuse(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a low-rank trial called numpy's BLAS")

    for name in ("dot", "vdot", "inner"):
        monkeypatch.setattr(np, name, refuse)
    comp = _tail(rounding="nearest")  # a trial at step 0, none again in the next 5
    for step in range(6):
        comp.compress({"w": _low_rank_gradient(128, 256, step)})
    assert comp.lowrank is not None and len(comp.lowrank.trial_times_s) == 1
    assert comp.lowrank.rank_of("w") > 0


def test_the_first_chooser_of_a_process_loads_the_kernels_before_any_trial(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A process's first power step loads its kernels (through LAPACK it was up to 4 ms of
    CPU, 46 ms of wall seen at step 20): the chooser does it when it is made, once per
    process, so no timed trial pays for it."""
    calls = []
    power_step = lowrank_energy.power_step

    def counting_power_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape)
        return power_step(*args, **kwargs)

    monkeypatch.setattr(lowrank_energy, "power_step", counting_power_step)
    monkeypatch.setattr(lowrank_energy, "_linalg_warm", False)
    first = _tail()
    assert len(calls) == 1 and first.lowrank is not None and not first.lowrank.trial_times_s
    _tail()  # once per process, not per chooser
    assert len(calls) == 1
