"""/v1/packages: upload a working_dir (a zip of the user's code) for jobs to run; read its facts."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request, Response, status

from service.deps import PackagesDep, SettingsDep, guard_reads, require_token
from service.packages import NoSuchPackage
from service.routing import AuthFirstRoute
from service.schemas import PackagePublic
from service.submission import require_custom_jobs

UPLOAD_PATH = "/v1/packages"
router = APIRouter(prefix=UPLOAD_PATH, tags=["packages"], route_class=AuthFirstRoute)
PackageIdPath = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="The package's id (SHA-256).")]


@router.post(
    "",
    operation_id="upload_package",
    status_code=status.HTTP_201_CREATED,
    dependencies=[Depends(require_token)],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/zip": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    responses={
        200: {"description": "The same code was uploaded before: its package, reused"},
        403: {"description": "Custom entrypoints are turned off"},
        413: {"description": "The zip, or what it unpacks to, is too large"},
        422: {"description": "Not a zip, a corrupt one, or a path outside the package (.., symlinks)"},
    },
)
async def upload_package(
    request: Request, response: Response, store: PackagesDep, settings: SettingsDep
) -> PackagePublic:
    """Store a zip of your working dir (checked, unpacked, kept by content hash). Name its
    ``id`` as ``working_dir`` in a job with an ``entrypoint`` of your own."""
    require_custom_jobs(settings)
    body = await request.body()  # bounded by the body limit of this path (package_max_bytes)
    info, new = await asyncio.to_thread(store.add, [body])
    if not new:
        response.status_code = status.HTTP_200_OK
    return PackagePublic(**vars(info))


@router.get("/{package_id}", operation_id="get_package", dependencies=[Depends(guard_reads)])
def get_package(package_id: PackageIdPath, store: PackagesDep) -> PackagePublic:
    info = store.get(package_id)
    if info is None:
        raise NoSuchPackage(f"no package {package_id!r}; upload one with POST /v1/packages")
    return PackagePublic(**vars(info))
