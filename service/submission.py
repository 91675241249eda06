"""From a validated job spec to what Ray is handed: the entrypoint and the runtime_env.

The built-in trainer: `<job_python> -m jobs.train --config ... --set ...` in the service's own
working dir. The user's own code: `<job_python> <script or -m module> <args>` in the uploaded
package (or the service's working dir), with the user's pip requirements; when the service
ships its own code (``job_working_dir`` set: the cluster has no tail-ray installed) it also
ships ``tail_ray`` as a ``py_module``, so the script's ``import tail_ray.train`` works there.
Everything is checked before anything is stored: the package exists, the entrypoint is in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tail_ray
from service.errors import Forbidden, ServiceError
from service.packages import PackageStore
from service.schemas import EntrypointSpec, JobCreate
from service.settings import Settings

TAIL_RAY_DIR = Path(tail_ray.__file__).resolve().parent


class CustomJobsDisabled(Forbidden):
    code = "custom_jobs_disabled"


def require_custom_jobs(settings: Settings) -> None:
    """A job with its own entrypoint, or a package for one, on a service that allows them."""
    if not settings.custom_jobs_enabled:
        raise CustomJobsDisabled(
            "this service runs the built-in trainer only: jobs with an entrypoint of their own and "
            "package uploads are turned off (TAIL_RAY_CUSTOM_JOBS_ENABLED=false)"
        )


class EntrypointNotFound(ServiceError):
    status_code = 422
    code = "entrypoint_not_found"


@dataclass(frozen=True)
class Submission:
    name: str
    entrypoint: str
    runtime_env: dict[str, Any] | None  # None: the service's default (its working dir)
    spec: dict[str, Any]


def plan_submission(spec: JobCreate, settings: Settings, packages: PackageStore) -> Submission:
    """The submission for ``spec``, or a 4xx saying what to fix (nothing is stored yet)."""
    if spec.entrypoint is None:
        spec.to_job_config()  # the runner's own checks; ConfigError -> 422
        return Submission(spec.name, spec.train_command(settings.job_python), None, spec.stored_spec())
    require_custom_jobs(settings)
    root = packages.require(spec.working_dir) if spec.working_dir else settings.job_working_dir
    check_entrypoint(spec.entrypoint, root)
    runtime_env: dict[str, Any] = {}
    if root is not None:
        runtime_env["working_dir"] = str(root)
    if settings.job_working_dir is not None and spec.working_dir is not None:
        runtime_env["py_modules"] = [str(TAIL_RAY_DIR)]
    if spec.pip:
        runtime_env["pip"] = list(spec.pip)
    name = spec.name if "name" in spec.model_fields_set else spec.entrypoint.stem[:64]
    return Submission(name, spec.entrypoint.command(settings.job_python), runtime_env, spec.stored_spec())


def check_entrypoint(entrypoint: EntrypointSpec, root: Path | None) -> None:
    """The script (or module) must be in the working dir the job will run in."""
    if root is None:
        if entrypoint.script is not None:
            raise EntrypointNotFound(
                f"entrypoint.script {entrypoint.script!r}: this service ships no working dir of its own; "
                "upload yours (POST /v1/packages) and name it as working_dir"
            )
        return  # a module installed on the cluster's image: only the cluster can tell
    where = "the uploaded package" if root.name == "files" else f"the service's working dir {root}"
    if entrypoint.script is not None:
        if not (root / entrypoint.script).is_file():
            raise EntrypointNotFound(f"entrypoint.script {entrypoint.script!r} is not a file in {where}")
        return
    parts = str(entrypoint.module).split(".")
    base = root.joinpath(*parts)
    if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
        raise EntrypointNotFound(
            f"entrypoint.module {entrypoint.module!r}: neither {'/'.join(parts)}.py nor "
            f"{'/'.join(parts)}/__main__.py is in {where}"
        )
