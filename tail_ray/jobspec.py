"""The job specification: one frozen dataclass, loaded from YAML plus ``key=value`` overrides,
and the names of the registries' models and datasets. Imports neither Ray nor torch.

It is the contract between `python -m jobs.train`, `ray job submit`, and the control plane,
which validates a REST job spec against it in its own process (no Ray Train, no torch there)
and turns it into `--set key=value` arguments of the same entrypoint. It pickles across Ray,
so it holds plain values only. The runner's registries (tail_ray/runner/models.py,
datasets.py) check at import that they build exactly ``MODEL_NAMES`` / ``DATASET_NAMES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tail_ray.errors import ConfigError
from tail_ray.methods import METHODS

OPTIMIZERS = ("sgd", "adamw")
MODEL_NAMES = ("char_transformer", "digits_cnn", "synthetic_mlp")
DATASET_NAMES = ("digits", "stdlib_chars", "synthetic")
_SCALAR_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}
_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string"}


@dataclass(frozen=True)
class JobConfig:
    name: str = "digits-tail"
    model: str = "digits_cnn"  # one of MODEL_NAMES (tail_ray.runner.models' registry)
    dataset: str = "digits"  # one of DATASET_NAMES (tail_ray.runner.datasets' registry)
    method: str = "tail"  # one of tail_ray.methods.METHODS
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
    # Added by the runner (all optional, defaults keep older configs valid):
    optimizer: str = "sgd"  # one of OPTIMIZERS
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    # The lr is multiplied by lr_drop_factor once, at step int(lr_drop_at * steps); this gives
    # the Tail controller a real "right after an lr drop" phase. lr_drop_at=1.0: no drop.
    lr_drop_at: float = 0.75
    lr_drop_factor: float = 0.1
    elastic_resize_interval_s: float = 60.0  # how often Ray Train considers growing the group
    checkpoints_to_keep: int = 2
    metrics_queue_records: int = 20_000  # per worker; older records are dropped and counted

    def __post_init__(self) -> None:
        self._check_types()
        if self.method not in METHODS:
            raise ConfigError(f"method={self.method!r} is not one of {list(METHODS)}")
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"unknown model {self.model!r}; choose one of {list(MODEL_NAMES)}")
        if self.dataset not in DATASET_NAMES:
            raise ConfigError(f"unknown dataset {self.dataset!r}; choose one of {list(DATASET_NAMES)}")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ConfigError(
                f"need 1 <= min_workers <= max_workers, got {self.min_workers}..{self.max_workers}"
            )
        for name in ("steps", "batch_size", "checkpoint_every_steps", "metrics_every_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r} is not one of {list(OPTIMIZERS)}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0.0 < self.lr_drop_at <= 1.0:
            raise ConfigError(f"lr_drop_at is a fraction of steps in (0, 1], got {self.lr_drop_at}")
        if not 0.0 < self.lr_drop_factor <= 1.0:
            raise ConfigError(f"lr_drop_factor must be in (0, 1], got {self.lr_drop_factor}")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker < 0:
            raise ConfigError(
                f"need cpus_per_worker > 0 and gpus_per_worker >= 0, "
                f"got {self.cpus_per_worker} and {self.gpus_per_worker}"
            )
        if self.elastic_resize_interval_s <= 0:
            raise ConfigError(f"elastic_resize_interval_s must be > 0, got {self.elastic_resize_interval_s}")
        for name in ("checkpoints_to_keep", "metrics_queue_records"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_failures < -1:
            raise ConfigError(f"max_failures must be >= -1 (-1: retry forever), got {self.max_failures}")
        if not isinstance(self.compression, Mapping):
            raise ConfigError(f"compression must be a mapping of settings, got {self.compression!r}")

    def _check_types(self) -> None:
        """Reject values of the wrong type with a ConfigError (YAML and ``--set`` parse ``steps=1e3``
        as a string, ``lr=1`` as an int); ints are accepted (and stored) where floats are expected."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if expected == "float" and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
            elif expected in _SCALAR_TYPES and (
                not isinstance(value, _SCALAR_TYPES[expected]) or isinstance(value, bool)
            ):
                raise ConfigError(
                    f"{f.name} must be {_TYPE_WORDS[expected]}, got {value!r} ({type(value).__name__})"
                )

    def lr_at(self, step: int) -> float:
        """The learning rate for ``step`` (0-based): ``lr``, then ``lr * lr_drop_factor`` from
        the drop step on."""
        return self.lr * (self.lr_drop_factor if step >= self.lr_drop_step else 1.0)

    @property
    def lr_drop_step(self) -> int:
        return int(self.lr_drop_at * self.steps) if self.lr_drop_at < 1.0 else self.steps

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
            if key in _STR_FIELDS:
                value: Any = raw  # `--set job_id=123` or `name=2024` stay strings
            else:
                try:
                    value = yaml.safe_load(raw) if raw else ""
                except yaml.YAMLError as exc:
                    raise ConfigError(f"override {item!r}: cannot parse the value: {exc}") from None
            if key.startswith("compression."):
                data["compression"][key.removeprefix("compression.")] = value
            else:
                data[key] = value
        return JobConfig.from_mapping(data)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["compression"] = dict(self.compression)
        return out


_STR_FIELDS = frozenset(f.name for f in dataclasses.fields(JobConfig) if f.type == "str")
