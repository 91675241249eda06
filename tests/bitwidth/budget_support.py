"""The budget settings the bit-width tests start from (each test overrides what it is about)."""

from __future__ import annotations

from typing import Any

from tail_ray.bitwidth.policy import BudgetSettings


def budget_settings(**over: Any) -> BudgetSettings:
    base: dict[str, Any] = dict(
        noise_fraction=1.0,
        linear_noise_fraction=1.0,
        tau_default=0.25,
        tau_min=1e-3,
        tau_max=0.5,
        warmup_steps=0,
        critical_factor=0.5,
        critical_steps=10,
        lr_drop_ratio=0.8,
        norm_jump=2.0,
    )
    base.update(over)
    return BudgetSettings(**base)
