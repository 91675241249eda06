"""JobCreate: bounds, closed shape, and a faithful mapping onto the runner's JobConfig."""

from __future__ import annotations

import shlex

import pytest
from pydantic import ValidationError

from service.ray_client import is_train_entrypoint, name_from_entrypoint
from service.schemas import BASE_CONFIG, JobCreate
from tail_ray.errors import ConfigError


def test_defaults_map_onto_job_config_field_by_field() -> None:
    spec = JobCreate()
    cfg = spec.to_job_config()
    for key, value in spec.stored_spec().items():  # every field of a built-in-trainer job
        assert getattr(cfg, key) == value, key


@pytest.mark.parametrize(
    "fields",
    [
        {"name": "123", "lr": 1e-5, "seed": 7},  # a numeric-looking name stays a string; 1e-5 a float
        {"name": "yes", "method": "none", "min_workers": 1, "max_workers": 3, "optimizer": "adamw"},
        {"method": "powersgd", "compression": {"rank": 2}, "max_failures": -1},
        {"method": "tail", "compression": {"rounding": "nearest"}},
        # Values that YAML would misread if they were not written as literals (not validated
        # against a method: only the mapping is under test here).
        {"compression": {"bits": 4, "mode": "yes", "scale": 2.5e20, "flag": True}},
    ],
)
def test_overrides_round_trip_through_job_config(fields: dict) -> None:
    spec = JobCreate(**fields)
    validate = "compression" not in fields or fields.get("method") in ("powersgd", "tail")
    cfg = spec.to_job_config(validate=validate)
    for key, value in fields.items():
        got = dict(cfg.compression) if key == "compression" else getattr(cfg, key)
        assert got == value and type(got) is type(value), (key, got, value)


def test_entrypoint_is_the_train_module_with_quoted_overrides_only() -> None:
    spec = JobCreate(name="a.b-c", compression={"mode": "x y"[:1]})
    args = shlex.split(spec.train_command())
    assert args[:5] == ["python", "-m", "jobs.train", "--config", BASE_CONFIG]
    flags = args[5::2]
    assert set(flags) == {"--set"}
    assert is_train_entrypoint(spec.train_command())
    assert name_from_entrypoint(spec.train_command(), "default") == "a.b-c"


@pytest.mark.parametrize(
    ("fields", "bad_field"),
    [
        ({"steps": 0}, "steps"),
        ({"lr": 0}, "lr"),
        ({"model": "resnet9000"}, "model"),
        ({"dataset": "imagenet"}, "dataset"),
        ({"method": "magic"}, "method"),
        ({"name": "rm -rf /; echo"}, "name"),
        ({"name": "$(reboot)"}, "name"),
        ({"compression": {"Bad-Key": 1}}, "compression"),
        ({"compression": {"cmd": "$(reboot)"}}, "compression"),
        ({"compression": {f"k{i}": i for i in range(17)}}, "compression"),
        ({"runtime_env": {"pip": ["evil"]}}, "runtime_env"),
        ({"entrypoint": "bash"}, "entrypoint"),
        ({"cpus_per_worker": 0}, "cpus_per_worker"),
        ({"max_workers": 65}, "max_workers"),
    ],
)
def test_bad_specs_name_the_field(fields: dict, bad_field: str) -> None:
    with pytest.raises(ValidationError) as info:
        JobCreate(**fields)
    assert any(bad_field in err["loc"] for err in info.value.errors()), info.value.errors()


@pytest.mark.parametrize(
    ("method", "compression"),
    [
        ("tail", {"rank": 2}),
        ("tail", {"rounding": "round"}),
        ("none", {"bits": 4}),
        ("powersgd", {"bogus": 1}),
    ],
)
def test_compression_settings_the_method_rejects_are_a_config_error(method: str, compression: dict) -> None:
    spec = JobCreate(method=method, compression=compression)
    with pytest.raises(ConfigError, match=f"method={method!r}"):
        spec.to_job_config()


def test_min_workers_above_max_workers_is_rejected_with_both_values() -> None:
    with pytest.raises(ValidationError, match=r"min_workers \(3\) must be <= max_workers \(2\)"):
        JobCreate(min_workers=3, max_workers=2)


@pytest.mark.parametrize(
    ("entrypoint", "expected"),
    [
        ("python -m jobs.train --config jobs/configs/smoke.yaml", True),
        ("/usr/bin/python3 -u -m jobs.train --config x.yaml --set steps=3", True),
        ("python -m jobs.benchmark", False),
        ("python jobs/train.py", False),
        ("echo 'unbalanced", False),
    ],
)
def test_train_entrypoints_are_recognised(entrypoint: str, expected: bool) -> None:
    assert is_train_entrypoint(entrypoint) is expected


def test_spec_validation_loads_neither_ray_train_nor_torch() -> None:
    """The service validates a registry job spec against tail_ray.jobspec in its own process;
    a fresh interpreter shows what that import and a validation load."""
    import subprocess
    import sys

    code = (
        "import sys; from service.schemas import JobCreate; "
        "JobCreate(steps=10, method='qsgd').to_job_config(); "
        "print(sorted(m for m in ('torch', 'ray.train', 'numba') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
