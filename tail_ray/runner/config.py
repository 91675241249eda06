"""The job configuration: one frozen dataclass, loaded from YAML plus ``key=value`` overrides.

It is the contract between `python -m jobs.train`, `ray job submit`, and the control plane
(which turns a validated REST job spec into `--set key=value` arguments of the same
entrypoint). It pickles across Ray, so it holds plain values only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tail_ray.errors import ConfigError

METHODS = ("none", "fp16", "bf16", "powersgd", "qsgd", "topk", "tail")


@dataclass(frozen=True)
class JobConfig:
    name: str = "digits-tail"
    model: str = "digits_cnn"  # a name in tail_ray.runner.models' registry
    dataset: str = "digits"  # a name in tail_ray.runner.datasets' registry
    method: str = "tail"  # one of METHODS
    compression: Mapping[str, Any] = field(default_factory=dict)  # settings for the method
    min_workers: int = 2
    max_workers: int = 2
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    steps: int = 200
    batch_size: int = 32  # per worker
    lr: float = 0.05
    seed: int = 0
    checkpoint_every_steps: int = 50
    metrics_every_steps: int = 1
    max_failures: int = 3
    storage_path: str = ""  # "" -> ~/ray_results/tail_ray
    job_id: str = ""  # "" -> the Ray job's submission id, else the run name

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r} is not one of {list(METHODS)}")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ConfigError(
                f"need 1 <= min_workers <= max_workers, got {self.min_workers}..{self.max_workers}"
            )
        for name in ("steps", "batch_size", "checkpoint_every_steps", "metrics_every_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> JobConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | Path) -> JobConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config {path} must be a YAML mapping, got {type(data).__name__}")
        return cls.from_mapping(data)

    def with_overrides(self, overrides: list[str]) -> JobConfig:
        """Apply ``key=value`` strings; values parse as YAML scalars; ``compression.bits=4`` sets
        one compression setting."""
        data = dataclasses.asdict(self)
        data["compression"] = dict(self.compression)
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"override {item!r} must look like key=value")
            value = yaml.safe_load(raw) if raw else ""
            if key.startswith("compression."):
                data["compression"][key.removeprefix("compression.")] = value
            else:
                data[key] = value
        return JobConfig.from_mapping(data)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["compression"] = dict(self.compression)
        return out
