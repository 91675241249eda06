"""Service settings: read from the environment (prefix ``TAIL_RAY_``) once, in one place.

The app builds one ``Settings`` at start-up and hands it around through ``deps``; nothing
else in the service reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.storage import RetentionPolicy, parse_storage_url

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HOME = Path.home() / ".tail_ray"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TAIL_RAY_", extra="ignore", frozen=True, populate_by_name=True
    )

    # --- the service's own API ---
    api_token: SecretStr = Field(
        description="Bearer token every mutating route requires (set TAIL_RAY_API_TOKEN; "
        "`tail-ray up` generates one).",
        min_length=16,
    )
    read_requires_token: bool | None = Field(
        None,
        description="Guard GET routes with the token too. Unset: only requests that reach the "
        "service on an address beyond loopback need it (a service bound to 0.0.0.0 guards its "
        "reads; `tail-ray up`, on 127.0.0.1, leaves the local dashboard open). false: never, for a "
        "service behind an authenticating proxy. The job logs route needs the token always.",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["127.0.0.1", "localhost", "::1"],
        description="Host header names the service answers (comma-separated in "
        "TAIL_RAY_ALLOWED_HOSTS; '*' allows any). Loopback names by default, so a web page cannot "
        "read the local service by DNS rebinding; a deployment lists its own names. The "
        "/healthz and /readyz probes answer any Host.",
    )

    # --- storage ---
    db_path: Path = Field(
        DEFAULT_HOME / "service.sqlite", description="The SQLite file, when database_url is not set."
    )
    database_url: str | None = Field(
        None,
        description="Where jobs and metrics live: sqlite:///absolute/path.sqlite (embedded, one "
        "replica) or postgresql://user:password@host:port/database (several replicas, one of "
        "them ingesting). Unset: the SQLite file at db_path.",
    )
    retention_full_steps: int | None = Field(
        10_000,
        ge=1,
        description="Per job, keep every step's metric records for the newest this many steps; "
        "older steps keep every retention_every_k_steps-th step only. None keeps everything.",
    )
    retention_every_k_steps: int = Field(10, ge=1, le=1_000_000)
    retention_interval_s: float = Field(60.0, gt=0, le=86_400, description="How often retention runs.")

    # --- Ray ---
    ray_address: str = Field("auto", description="GCS address the service's driver connects to.")
    ray_dashboard_url: str = Field("http://127.0.0.1:8265", description="Ray job server (dashboard) URL.")
    ray_auth_token: SecretStr | None = Field(
        None,
        # RAY_AUTH_TOKEN too: Ray's own clients in this process use it, so the service must
        # know it to scrub it from what it returns and logs.
        validation_alias=AliasChoices("TAIL_RAY_RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN"),
        description="The Ray cluster's token (TAIL_RAY_RAY_AUTH_TOKEN, else RAY_AUTH_TOKEN); when "
        "unset it is read from ray_auth_token_path.",
    )
    ray_auth_token_path: Path = Path.home() / ".ray" / "auth_token"
    job_python: str = Field(
        "python",
        description="The interpreter in each job's entrypoint (`<job_python> -m jobs.train ...`). "
        "`tail-ray up` with a local head sets the one it runs under; with a remote cluster, name "
        "the cluster's (`tail-ray up --python`), else its PATH decides.",
        pattern=r"^[A-Za-z0-9_./+-]{1,255}$",
    )
    job_working_dir: Path | None = Field(
        REPO_ROOT,
        description="Directory shipped as the job's runtime_env working_dir (holds jobs/ and "
        "tail_ray/); None when the cluster's image already has the package installed.",
    )

    # --- users' own code (docs/service.md, "Your own code: the trust model") ---
    custom_jobs_enabled: bool = Field(
        True,
        description="Take jobs that run the user's own entrypoint and packages uploaded for them. A "
        "token holder can then run any code on the cluster, as with Ray's own job server; false "
        "turns both routes into 403 and leaves the built-in trainer's jobs only.",
    )
    packages_dir: Path | None = Field(
        None,
        description="Where uploaded working_dir packages are kept (default: packages/ beside the "
        "SQLite file; on PostgreSQL ~/.tail_ray/packages).",
    )
    package_max_bytes: int = Field(32 * 1024 * 1024, ge=1024, le=1024**3, description="Largest zip taken.")
    package_max_unpacked_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, le=4 * 1024**3, description="Largest package once unpacked."
    )
    package_max_files: int = Field(10_000, ge=1, le=1_000_000, description="Most entries in one zip.")

    # --- background work ---
    ingest_enabled: bool = True
    ingest_in_process: bool = Field(
        False,
        description="Run the ingester in a thread of the service process instead of its own child "
        "process. The child (default) has its own interpreter lock, so ingesting 100k records/s "
        "does not stall reads; a thread saves the child's start-up and memory (~100 MB).",
    )
    ingest_interval_s: float = Field(1.0, gt=0, le=60)
    ingest_niceness: int = Field(
        10,
        ge=0,
        le=19,
        description="CPU niceness of the ingest process (not with ingest_in_process): on a busy "
        "machine the service's reads run first, ingest takes what is left.",
    )
    ingest_batch_records: int = Field(
        5_000, ge=1, le=100_000, description="Records read from a sink and stored per transaction."
    )
    ingest_writers: int = Field(
        0,
        ge=0,
        le=4,  # PostgreSQL's write pool holds 4 connections
        description="Writer threads that store sink pages while the next ones are read, each "
        "job's pages in order on one of them. 0: the backend's choice (SQLite 1: one write lock; "
        "PostgreSQL 2).",
    )
    sync_interval_s: float = Field(3.0, gt=0, le=300)
    drain_grace_s: float = Field(5.0, ge=0, le=600)
    close_drained_sinks: bool = True
    ray_timeout_s: float = Field(10.0, gt=0, le=120)
    lost_after_s: float = Field(
        10.0,
        gt=0,
        le=86_400,
        description="A non-terminal job Ray has not known for this long (and that is at least this "
        "old) is marked FAILED as lost: its cluster was restarted or replaced.",
    )

    # --- requests ---
    max_body_bytes: int = Field(64 * 1024, ge=1024, le=16 * 1024 * 1024, description="Larger bodies get 413.")
    request_head_timeout_s: float = Field(
        10.0, gt=0, le=300, description="A request's headers must arrive within this (slowloris)."
    )
    body_read_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A request body that sends nothing for this long gets 408."
    )

    # --- reads ---
    sse_interval_s: float = Field(1.0, gt=0, le=60)
    read_max_staleness_s: float = Field(
        1.0,
        ge=0,
        le=60,
        description="A metrics read (layers, steps, summary) may be served from a result computed "
        "this long ago, without asking the database whether the job changed since: under ingest "
        "a hundred dashboards then cost a few queries a second, not one each. A result past half "
        "of it is rebuilt in the background while it is still served, so reads do not wait for "
        "builds. 0: every read sees the newest commit.",
    )
    logs_max_bytes: int = Field(256 * 1024, ge=1024, le=16 * 1024 * 1024)
    prometheus_max_jobs: int = Field(20, ge=1, le=1000)
    prometheus_max_layers: int = Field(64, ge=1, le=10_000)

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        if isinstance(value, str):
            return [h.strip() for h in value.split(",") if h.strip()]
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _normalize_hosts(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("list at least one host name (or '*')")
        return [h.lower().strip("[]") for h in value]

    @field_validator("job_working_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value in ("", "none", "None") else value

    @field_validator("database_url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        parse_storage_url(value)  # ValueError naming the accepted schemes
        return value

    @field_validator("packages_dir", mode="before")
    @classmethod
    def _empty_dir_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("db_path", "ray_auth_token_path", "job_working_dir", "packages_dir")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @property
    def storage_url(self) -> str:
        """The database the service opens: database_url, else the SQLite file at db_path."""
        return self.database_url or f"sqlite://{self.db_path}"

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(self.retention_full_steps, self.retention_every_k_steps)

    def package_root(self) -> Path:
        """packages_dir, else ``packages/`` beside the SQLite file the service opens (which
        database_url may name instead of db_path), else, on PostgreSQL, in DEFAULT_HOME."""
        if self.packages_dir is not None:
            return self.packages_dir
        backend, target = parse_storage_url(self.storage_url)
        return (Path(target).parent if backend == "sqlite" else DEFAULT_HOME) / "packages"

    def ray_token(self) -> str | None:
        """The Ray cluster's token: from settings, else from Ray's token file, else None."""
        if self.ray_auth_token is not None:
            return self.ray_auth_token.get_secret_value()
        try:
            token = self.ray_auth_token_path.read_text().strip()
        except OSError:
            return None
        return token or None
