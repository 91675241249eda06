"""Pydantic models at the service boundary: job specs in, jobs and metrics out.

``JobCreate`` describes a job one of two ways, every field a plain bounded value and unknown
fields rejected:

- the built-in trainer (no ``entrypoint``): model / dataset / method from the registries and
  training settings; it maps onto ``tail_ray.jobspec.JobConfig`` through ``--set key=value``
  overrides, validated here against the same spec module the runner reads (no Ray Train, no
  torch in this process; compression settings, when given, are checked by building the
  method's hook state, which loads torch);
- the user's own code: ``entrypoint`` (a script or module of the ``working_dir`` package, and
  its args), ``working_dir`` (a package id from POST /v1/packages) and ``pip`` requirements
  for Ray's runtime_env. Only a token holder submits, and a setting turns it off: such a job
  runs arbitrary code on the cluster (docs/service.md, the trust model).
"""

from __future__ import annotations

import enum
import json
import math
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from service.status import JobStatus
from tail_ray.jobspec import DATASET_NAMES, MODEL_NAMES, OPTIMIZERS, JobConfig
from tail_ray.methods import METHODS

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
ModelName = enum.Enum("ModelName", {n: n for n in MODEL_NAMES}, type=str)  # type: ignore[misc]
DatasetName = enum.Enum("DatasetName", {n: n for n in DATASET_NAMES}, type=str)  # type: ignore[misc]
Method = enum.Enum("Method", {n: n for n in METHODS}, type=str)  # type: ignore[misc]
Optimizer = enum.Enum("Optimizer", {n: n for n in OPTIMIZERS}, type=str)  # type: ignore[misc]

JobName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
SettingKey = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,39}$")]
SettingText = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{0,64}$")]
SettingValue = bool | int | float | SettingText
MAX_SETTING_INT = 2**53

# The user's own code. A script is a relative path inside the package whose every part starts
# with a letter, digit or underscore (so never "..", never hidden, never absolute).
ScriptPath = Annotated[
    str,
    StringConstraints(
        pattern=r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*/){0,15}[A-Za-z0-9_][A-Za-z0-9_.-]*\.py$", max_length=255
    ),
]
ModuleName = Annotated[
    str,
    StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*){0,15}$", max_length=200),
]
Arg = Annotated[str, StringConstraints(pattern=r"^[^\x00]*$", max_length=1024)]
PackageId = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# A name with optional extras and version clauses: no URL, no path, no pip option, no marker.
_VERSION_CLAUSE = r"(?:===|==|~=|!=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
Requirement = Annotated[
    str,
    StringConstraints(
        pattern=rf"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?(?:\[[A-Za-z0-9._,-]+\])?"
        rf"(?:\s*{_VERSION_CLAUSE}(?:\s*,\s*{_VERSION_CLAUSE})*)?$",
        max_length=200,
    ),
]
# What only the built-in trainer reads; a job with an entrypoint of its own sets none of them.
CUSTOM_FIELDS = frozenset({"entrypoint", "working_dir", "pip"})


class EntrypointSpec(BaseModel):
    """The user's own entrypoint: ``script`` (a path in the package) or ``module`` (run with
    ``-m``), and ``args``. It runs as ``<job_python> <script> <args...>``, each part quoted."""

    model_config = ConfigDict(extra="forbid")

    script: ScriptPath | None = Field(None, description="e.g. my_train.py or train/main.py")
    module: ModuleName | None = Field(None, description="e.g. mypkg.train (run with python -m)")
    args: list[Arg] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _one_target(self) -> EntrypointSpec:
        if (self.script is None) == (self.module is None):
            raise ValueError("entrypoint takes exactly one of script and module")
        return self

    def command(self, python: str) -> str:
        head = [python, self.script] if self.script is not None else [python, "-m", str(self.module)]
        return shlex.join([*head, *self.args])

    @property
    def stem(self) -> str:
        if self.script is not None:
            return self.script.rsplit("/", 1)[-1].removesuffix(".py")
        return str(self.module).rsplit(".", 1)[-1]


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
    entrypoint: EntrypointSpec | None = Field(
        None,
        description="Your own code instead of the built-in trainer: a script or module of working_dir "
        "and its args. Its model goes through tail_ray.train.prepare_model; the built-in trainer's "
        "fields do not apply.",
    )
    working_dir: PackageId | None = Field(
        None, description="Package id from POST /v1/packages (default: the service's own working dir)."
    )
    pip: list[Requirement] = Field(
        default_factory=list, max_length=32, description="Requirements Ray installs (runtime_env.pip)."
    )

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

    @model_validator(mode="after")
    def _one_kind_of_job(self) -> JobCreate:
        if self.entrypoint is None:
            stray = sorted((CUSTOM_FIELDS - {"entrypoint"}) & self.model_fields_set)
            if stray:
                raise ValueError(f"{' and '.join(stray)} go with an entrypoint of your own; add entrypoint")
            return self
        builtin = sorted(self.model_fields_set - CUSTOM_FIELDS - {"name"})
        if builtin:
            raise ValueError(
                f"{', '.join(builtin)}: fields of the built-in trainer; a job with an entrypoint of its "
                "own takes its settings as entrypoint.args"
            )
        return self

    @property
    def is_custom(self) -> bool:
        return self.entrypoint is not None

    def stored_spec(self) -> dict[str, Any]:
        """What the job table keeps: the fields that apply to this kind of job."""
        if self.entrypoint is not None:
            return self.model_dump(mode="json", include={"name", *CUSTOM_FIELDS})
        return self.model_dump(mode="json", exclude=set(CUSTOM_FIELDS))

    def overrides(self) -> list[str]:
        """``key=value`` strings for ``--set``; values are YAML/JSON literals so a name such
        as ``123`` or ``yes`` stays a string."""
        out = []
        for key, value in self.model_dump(exclude={"compression", *CUSTOM_FIELDS}).items():
            out.append(f"{key}={value}" if key in _RAW_STRING_FIELDS else f"{key}={_literal(value)}")
        for key, value in sorted(self.compression.items()):
            out.append(f"compression.{key}={_literal(value)}")
        return out

    def to_job_config(self, validate: bool = True) -> JobConfig:
        """What the runner will see. Raises ``ConfigError`` where the runner disagrees: its
        config checks and, with ``validate``, the compression settings the method rejects, so a
        bad spec is a 422 here rather than a failed job later."""
        cfg = JobConfig.from_yaml(BASE_CONFIG_PATH).with_overrides(self.overrides())
        if validate and cfg.compression:
            # The method's settings classes live beside its torch code: only a spec that sets
            # some pays for loading it (once per process).
            from tail_ray.train.session import check_method_settings

            check_method_settings(cfg.method, cfg.compression)
        return cfg

    def train_command(self, python: str = "python") -> str:
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


class PackagePublic(BaseModel):
    id: str = Field(description="SHA-256 of the package's files: name it as a job's working_dir.")
    files: int
    unpacked_bytes: int
    zip_bytes: int = Field(description="Size of the zip that first brought this package.")
    created_at: float = Field(description="Unix time, seconds.")


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
