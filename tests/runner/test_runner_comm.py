"""The runner's adapter over the comm hook, at world size 1 (no DDP wrapper)."""

from __future__ import annotations

import pytest

from tail_ray.errors import ConfigError
from tail_ray.runner.comm import Comm, compression_settings
from tail_ray.runner.datasets import make_dataset
from tail_ray.runner.models import loss_fn, make_model


def test_seed_is_per_worker_reproducible_and_user_wins():
    a0 = compression_settings("tail", {}, seed=1, rank=0)
    a1 = compression_settings("tail", {}, seed=1, rank=1)
    assert a0["seed"] != a1["seed"]
    assert a0 == compression_settings("tail", {}, seed=1, rank=0)
    assert compression_settings("qsgd", {"seed": 5, "bits": 4}, seed=1, rank=0) == {"seed": 5, "bits": 4}
    assert compression_settings("none", {}, seed=1, rank=0) == {}


def test_world_size_one_still_compresses_and_reports_every_layer():
    ds = make_dataset("digits")
    model = make_model("digits_cnn", ds)
    comm = Comm(model, "tail", {}, seed=0, rank=0)
    x, y = ds.batch(seed=0, step=0, rank=0, world_size=1, batch_size=32)
    loss_fn(ds, model(x), y).backward()
    comm.after_backward()
    m = comm.drain()
    assert {s.layer for s in m.layers} == {n for n, _ in model.named_parameters()}
    assert m.bytes_sent == 0 and m.raw_bytes == 4 * sum(p.numel() for p in model.parameters())
    big = next(s for s in m.layers if s.layer == "fc1.weight")
    assert big.bits < 32 and big.encoded_bytes < big.raw_bytes


def test_unknown_compression_setting_is_a_config_error():
    ds = make_dataset("digits")
    with pytest.raises(ConfigError):
        Comm(make_model("digits_cnn", ds), "tail", {"no_such_setting": 1})


def test_step_records_carry_both_stages_of_a_sharded_collective():
    """One row per layer, then one per second-stage slice under "<name>@stage2" with that
    stage's own bits and bytes, then the step record."""
    from tail_ray.collective import HookStepMetrics
    from tail_ray.compression.stats import LayerStats
    from tail_ray.runner.config import JobConfig
    from tail_ray.runner.train_loop import STAGE_TWO_SUFFIX, step_records

    cfg = JobConfig.from_yaml("jobs/configs/digits-tail.yaml")
    first = LayerStats("fc1.weight", 8192, 4, 0.5, 32768, 4200, 0.1, "rans")
    second = LayerStats("fc1.weight", 4096, 5, 0.7, 16384, 2600, 0.05, "bitpack")
    comm = HookStepMetrics(layers=[first], stage_two=[second], bytes_sent=6800)
    rows = step_records(cfg, "job", step=3, rank=1, world_size=4, comm=comm, step_s=0.1, loss=2.0)
    assert [(r["layer"], r["bits"], r["encoded_bytes"]) for r in rows[:2]] == [
        ("fc1.weight", 4, 4200),
        (f"fc1.weight{STAGE_TWO_SUFFIX}", 5, 2600),
    ]
    assert all(r["step"] == 3 and r["rank"] == 1 for r in rows)
    assert len(rows) == 3 and rows[2]["bytes_sent"] == 6800
