"""JobConfig validation and the jobs.train CLI's handling of bad input (no Ray needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tail_ray.errors import ConfigError
from tail_ray.runner.config import JobConfig
from tail_ray.runner.trainer import resolve_job_id, scaling_config, submission_id_from_env, validate_job

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO_ROOT / "jobs/configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_load_and_name_known_parts(path):
    cfg = JobConfig.from_yaml(path)
    validate_job(cfg)
    assert cfg.name == path.stem


def test_required_configs_are_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"digits-tail", "digits-none", "charlm-tail", "synthetic-tail", "smoke"} <= names


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("method=zip", "method='zip' is not one of"),
        ("steps=abc", "steps must be an integer"),
        ("steps=0", "steps must be >= 1"),
        ("lr=-1", "lr must be > 0"),
        ("min_workers=3", "min_workers <= max_workers"),
        ("optimizer=lbfgs", "optimizer='lbfgs' is not one of"),
        ("lr_drop_at=0", "lr_drop_at is a fraction"),
        ("momentum=1.5", "momentum must be in [0, 1)"),
        ("no_such_key=1", "unknown config keys ['no_such_key']"),
        ("steps", "must look like key=value"),
    ],
)
def test_bad_values_raise_config_error_that_names_the_fix(override, words):
    with pytest.raises(ConfigError) as err:
        JobConfig().with_overrides([override])
    assert words in str(err.value)


def test_unknown_model_or_dataset_fails_before_any_worker_starts():
    with pytest.raises(ConfigError, match="unknown model 'resnet'"):
        validate_job(JobConfig(model="resnet"))
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'"):
        validate_job(JobConfig(dataset="imagenet"))


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["compression.no_such=1"], "no_such"),
        (["method=none", "compression.bits=4"], "takes no settings"),
        (["method=topk", "compression.density=2"], "density"),
        (["method=powersgd", "compression.rank=0"], "rank"),
    ],
)
def test_bad_compression_settings_fail_on_the_driver(overrides, words):
    with pytest.raises(ConfigError, match=words):
        validate_job(JobConfig().with_overrides(overrides))


def test_overrides_keep_types_and_set_compression_keys():
    cfg = JobConfig().with_overrides(["lr=1", "job_id=123", "compression.bits=4", "lr_drop_at=0.5"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.job_id == "123"
    assert cfg.compression == {"bits": 4}
    assert JobConfig.from_mapping(cfg.to_dict()) == cfg


def test_lr_schedule_drops_once():
    cfg = JobConfig(steps=100, lr=0.1, lr_drop_at=0.75, lr_drop_factor=0.1)
    assert cfg.lr_at(0) == cfg.lr_at(74) == 0.1
    assert cfg.lr_at(75) == cfg.lr_at(99) == pytest.approx(0.01)
    assert JobConfig(steps=100, lr_drop_at=1.0).lr_at(99) == JobConfig().lr


def test_scaling_is_elastic_only_for_a_range():
    fixed = scaling_config(JobConfig(min_workers=2, max_workers=2))
    assert fixed.num_workers == 2 and not fixed.elasticity_enabled
    elastic = scaling_config(JobConfig(min_workers=1, max_workers=4, elastic_resize_interval_s=7))
    assert elastic.num_workers == (1, 4) and elastic.elasticity_enabled
    assert elastic.elastic_resize_monitor_interval_s == 7


def test_job_id_comes_from_config_then_ray_job_then_is_generated():
    env = {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"metadata": {"job_submission_id": "raysubmit_X"}})}
    assert submission_id_from_env(env) == "raysubmit_X"
    assert submission_id_from_env({}) is None
    assert submission_id_from_env({"RAY_JOB_CONFIG_JSON_ENV_VAR": "not json"}) is None
    assert resolve_job_id(JobConfig(job_id="mine"), env) == "mine"
    assert resolve_job_id(JobConfig(), env) == "raysubmit_X"
    a, b = resolve_job_id(JobConfig(name="x"), {}), resolve_job_id(JobConfig(name="x"), {})
    assert a.startswith("x-") and a != b


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobs.train", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "token", "HOME": str(Path.home())},
    )


def test_cli_bad_config_exits_2_with_a_clear_message():
    out = run_cli("--config", "jobs/configs/smoke.yaml", "--set", "method=zip")
    assert out.returncode == 2
    assert "bad job config" in out.stderr and "method='zip' is not one of" in out.stderr
    missing = run_cli("--config", "jobs/configs/nope.yaml")
    assert missing.returncode == 2 and "cannot read config" in missing.stderr


def test_cli_help_lists_models_methods_and_keys():
    out = run_cli("--help")
    assert out.returncode == 0
    for word in ("digits_cnn", "stdlib_chars", "tail", "--set", "checkpoint_every_steps"):
        assert word in out.stdout
