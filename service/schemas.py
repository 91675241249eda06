"""Pydantic models at the service boundary: job specs in, jobs and metrics out.

``JobCreate`` is a closed, bounded description of a training job: every field is a plain
value with limits, unknown fields are rejected, and model / dataset / method come from the
registries, so nothing a client sends can become code, a command line or a runtime_env.
It maps onto ``tail_ray.runner.config.JobConfig`` through ``--set key=value`` overrides.
"""

from __future__ import annotations

import enum
import json
import math
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from tail_ray.methods import METHODS
from tail_ray.runner.config import OPTIMIZERS, JobConfig
from tail_ray.runner.datasets import dataset_names
from tail_ray.runner.models import model_names
from tail_ray.runner.trainer import validate_job

REPO_ROOT = Path(__file__).resolve().parents[1]

TRAIN_MODULE = "jobs.train"
# The entrypoint's --config; every JobCreate field is then set with --set, so the file only
# supplies the knobs JobCreate does not expose (checkpoints kept, metrics queue size, ...).
BASE_CONFIG = "jobs/configs/digits-tail.yaml"
# JobConfig takes these raw (not YAML-parsed) from --set; our patterns keep them shell- and
# YAML-harmless anyway.
BASE_CONFIG_PATH = REPO_ROOT / BASE_CONFIG
_RAW_STRING_FIELDS = frozenset({"name", "model", "dataset", "method", "optimizer"})

# Enums built from the registries so OpenAPI lists the allowed values.
ModelName = enum.Enum("ModelName", {n: n for n in model_names()}, type=str)  # type: ignore[misc]
DatasetName = enum.Enum("DatasetName", {n: n for n in dataset_names()}, type=str)  # type: ignore[misc]
Method = enum.Enum("Method", {n: n for n in METHODS}, type=str)  # type: ignore[misc]
Optimizer = enum.Enum("Optimizer", {n: n for n in OPTIMIZERS}, type=str)  # type: ignore[misc]

JobName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
SettingKey = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,39}$")]
SettingText = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{0,64}$")]
SettingValue = bool | int | float | SettingText
MAX_SETTING_INT = 2**53

TERMINAL_STATUSES = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
JobStatus = Literal["PENDING", "RUNNING", "STOPPING", "STOPPED", "SUCCEEDED", "FAILED"]


class JobCreate(BaseModel):
    """A declarative training job. Fields mirror ``JobConfig``; see docs/service.md.

    Numbers are strict: a bool or a string is never taken for a number (``"steps": true`` or
    ``"steps": "40"`` is a 422, not a 1- or 40-step job); an integer is a valid float, a float
    is not a valid integer. ``allow_inf_nan=False`` rejects NaN and +-Infinity everywhere,
    compression settings included (Python's JSON parser accepts them, and ``1e400``
    overflows to Infinity).
    """

    model_config = ConfigDict(extra="forbid", use_enum_values=True, allow_inf_nan=False)

    name: JobName = "digits-tail"
    model: ModelName = "digits_cnn"  # type: ignore[assignment]
    dataset: DatasetName = "digits"  # type: ignore[assignment]
    method: Method = "tail"  # type: ignore[assignment]
    compression: dict[SettingKey, SettingValue] = Field(
        default_factory=dict, max_length=16, description="Settings of the compression method."
    )
    min_workers: int = Field(2, ge=1, le=64, strict=True)
    max_workers: int = Field(2, ge=1, le=64, strict=True)
    cpus_per_worker: float = Field(1.0, gt=0, le=64, strict=True)
    gpus_per_worker: float = Field(0.0, ge=0, le=8, strict=True)
    steps: int = Field(200, ge=1, le=1_000_000, strict=True)
    batch_size: int = Field(32, ge=1, le=65_536, description="Per worker.", strict=True)
    lr: float = Field(0.05, gt=0, le=10, strict=True)
    optimizer: Optimizer = "sgd"  # type: ignore[assignment]
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD only.", strict=True)
    weight_decay: float = Field(0.0, ge=0, le=1, strict=True)
    lr_drop_at: float = Field(
        0.75,
        gt=0,
        le=1,
        strict=True,
        description="Fraction of steps after which lr is multiplied by lr_drop_factor.",
    )
    lr_drop_factor: float = Field(0.1, gt=0, le=1, strict=True)
    seed: int = Field(0, ge=0, le=2**31 - 1, strict=True)
    checkpoint_every_steps: int = Field(50, ge=1, le=1_000_000, strict=True)
    metrics_every_steps: int = Field(1, ge=1, le=10_000, strict=True)
    max_failures: int = Field(3, ge=-1, le=100, description="-1: retry forever.", strict=True)

    @field_validator("compression", mode="before")
    @classmethod
    def _bounded_settings(cls, value: Any) -> Any:
        # One clear error for a non-finite or huge number, where the value union would list
        # one failure per member type (bool, int, float, str). Integers are bounded like every
        # other field: +-2**53 is exact in any JSON client and keeps the entrypoint short.
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, float) and not math.isfinite(item):
                    raise ValueError(f"compression setting {key!r} must be a finite number, got {item}")
                if isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_SETTING_INT:
                    raise ValueError(
                        f"compression setting {key!r} must be an integer within +-2**53, "
                        f"got one of {item.bit_length()} bits"
                    )
        return value

    @model_validator(mode="after")
    def _workers_ordered(self) -> JobCreate:
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) must be <= max_workers ({self.max_workers})")
        return self

    def overrides(self) -> list[str]:
        """``key=value`` strings for ``--set``; values are YAML/JSON literals so a name such
        as ``123`` or ``yes`` stays a string."""
        out = []
        for key, value in self.model_dump(exclude={"compression"}).items():
            out.append(f"{key}={value}" if key in _RAW_STRING_FIELDS else f"{key}={_literal(value)}")
        for key, value in sorted(self.compression.items()):
            out.append(f"compression.{key}={_literal(value)}")
        return out

    def to_job_config(self, validate: bool = True) -> JobConfig:
        """What the runner will see. Raises ``ConfigError`` where the runner disagrees: its
        config checks and, with ``validate``, its driver-side checks (compression settings the
        method rejects), so a bad spec is a 422 here rather than a failed job later."""
        cfg = JobConfig.from_yaml(BASE_CONFIG_PATH).with_overrides(self.overrides())
        if validate:
            validate_job(cfg)
        return cfg

    def entrypoint(self, python: str = "python") -> str:
        args = [python, "-m", TRAIN_MODULE, "--config", BASE_CONFIG]
        for item in self.overrides():
            args += ["--set", item]
        return shlex.join(args)


def _literal(value: Any) -> str:
    if isinstance(value, float) and not isinstance(value, bool):
        text = repr(value)
        # PyYAML reads "1e-05" as a string; it wants a dot in the mantissa ("1.0e-05").
        if "e" in text and "." not in text:
            mantissa, _, exponent = text.partition("e")
            text = f"{mantissa}.0e{exponent}"
        return text
    return json.dumps(value)


class JobPublic(BaseModel):
    id: str
    name: str
    source: Literal["api", "ray"] = Field(description="api: submitted here; ray: found via `ray job submit`.")
    status: JobStatus
    message: str
    entrypoint: str
    spec: dict[str, Any] | None
    created_at: float = Field(description="Unix time, seconds.")
    started_at: float | None
    ended_at: float | None


class JobsPage(BaseModel):
    items: list[JobPublic]
    total: int
    limit: int
    offset: int


class JobLogs(BaseModel):
    job_id: str
    logs: str
    truncated: bool


class LayerLatest(BaseModel):
    """The newest step seen for one layer, aggregated over the ranks that reported it."""

    layer: str
    step: int
    ranks: int
    numel: int
    bits: float = Field(description="Mean over ranks.")
    density: float | None = Field(description="Mean over ranks; null when no rank measured a finite value.")
    raw_bytes: int = Field(description="Summed over ranks.")
    encoded_bytes: int = Field(description="Summed over ranks.")
    ratio: float = Field(description="raw_bytes / encoded_bytes.")
    rel_error: float | None = Field(description="Mean over ranks; null when no rank measured a finite value.")
    code: str


class StepPoint(BaseModel):
    """One step summed (bytes) or maxed (times: the slowest rank bounds the step) over ranks."""

    step: int
    ranks: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    raw_bytes: int
    ratio: float
    # null where no rank reported a finite value (NaN/inf are stored as NULL)
    loss: float | None = Field(description="Mean over ranks.")
    step_s: float | None
    compress_s: float | None
    decode_s: float | None
    comm_s: float | None
    method: str
    wall_time_s: float | None


class StepsPage(BaseModel):
    job_id: str
    items: list[StepPoint]
    next_after_step: int = Field(description="Pass as after_step to get what follows.")


class IngestState(BaseModel):
    cursor_seq: int
    records: int
    missed: int
    dropped_in_sink: int
    dropped_by_workers: int
    drained: bool


class MetricsSummary(BaseModel):
    job_id: str
    steps: int
    last_step: int | None
    world_sizes: list[int]
    raw_bytes: int
    bytes_sent: int
    bytes_received: int
    traffic_saved_bytes: int
    traffic_saved_fraction: float
    ratio: float = Field(description="Total raw bytes / total bytes sent.")
    mean_layer_ratio: float | None
    last_loss: float | None
    layers: int
    ingest: IngestState


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(default_factory=dict)
