"""Working-dir packages: a user's code uploaded as a zip, checked, unpacked once and kept by
content hash under the service's data directory, for jobs to run (``runtime_env.working_dir``).

A package is the tree of regular files a zip holds. Its id is the SHA-256 of that tree in a
canonical form (sorted paths, each with its executable bit and its bytes' SHA-256), so the same
code zipped twice, by any tool, is one package, stored once and reused by every job naming it.

Refused, with nothing stored: a body that is not a zip or fails its CRCs; more than
``max_files`` entries or more than ``max_unpacked_bytes`` once unpacked (counted while
unpacking, never trusted from the zip's headers: a zip bomb stops at the limit); a path that is
absolute, climbs out with ``..``, has a backslash, a drive or a NUL, or appears twice; an entry
that is not a regular file or directory (symlinks, devices). A package is built in a temporary
directory next to the store and renamed into place in one step, so a package directory either
holds the whole checked tree or does not exist.

Layout: ``<root>/<id>/files/`` (the working dir) and ``<root>/<id>/package.json`` (its facts).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from service.errors import ServiceError

PACKAGE_FILE = "package.json"
FILES_DIR = "files"
COPY_CHUNK_BYTES = 1 << 20


class PackageInvalid(ServiceError):
    status_code = 422
    code = "invalid_package"


class PackageTooLarge(ServiceError):
    status_code = 413
    code = "package_too_large"


class PackageNotFound(ServiceError):
    status_code = 422  # named by a job spec's field: the spec is what is wrong
    code = "package_not_found"


class NoSuchPackage(ServiceError):
    """GET of an id the store does not hold (a job spec naming one gets PackageNotFound)."""

    status_code = 404
    code = "package_not_found"


@dataclass(frozen=True)
class PackageInfo:
    id: str
    files: int
    unpacked_bytes: int
    zip_bytes: int
    created_at: float


@dataclass(frozen=True)
class Limits:
    max_zip_bytes: int
    max_unpacked_bytes: int
    max_files: int


def check_member_path(name: str) -> PurePosixPath:
    """``name`` as a relative path inside the package, or ``PackageInvalid`` saying why not."""
    if "\\" in name or "\x00" in name:
        raise PackageInvalid(f"zip entry {name!r}: backslashes and NUL are not allowed in paths")
    path = PurePosixPath(name)
    if path.is_absolute() or (path.parts and path.parts[0].endswith(":")):
        raise PackageInvalid(f"zip entry {name!r}: absolute paths are not allowed")
    if ".." in path.parts:
        raise PackageInvalid(f"zip entry {name!r} points outside the package ('..')")
    if not path.parts or path.parts == (".",):
        raise PackageInvalid(f"zip entry {name!r} has no name")
    return path


def _kind(info: zipfile.ZipInfo) -> str:
    """'dir', 'file', or what else the entry is (a symlink, a device, ...)."""
    mode = info.external_attr >> 16
    if info.is_dir():
        return "dir"
    if stat.S_IFMT(mode) == 0 or stat.S_ISREG(mode):  # no file type (Windows zips, writestr): a file
        return "file"
    return "symlink" if stat.S_ISLNK(mode) else "special file"


class PackageStore:
    def __init__(self, root: Path, limits: Limits) -> None:
        self.root = root
        self.limits = limits

    def files_dir(self, package_id: str) -> Path:
        return self.root / package_id / FILES_DIR

    def get(self, package_id: str) -> PackageInfo | None:
        try:
            data = json.loads((self.root / package_id / PACKAGE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return PackageInfo(**data)

    def require(self, package_id: str) -> Path:
        """The working dir of ``package_id``, or ``PackageNotFound`` naming the field."""
        if self.get(package_id) is None:
            raise PackageNotFound(
                f"working_dir: no package {package_id!r} on this service; upload it with POST /v1/packages"
            )
        return self.files_dir(package_id)

    def add(self, body: Iterable[bytes]) -> tuple[PackageInfo, bool]:
        """Check and store the zip arriving in ``body``; returns (the package, whether it is new)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.root))
        try:
            zip_path = work / "upload.zip"
            zip_bytes = self._receive(body, zip_path)
            files_dir = work / FILES_DIR
            package_id, files, unpacked = self._unpack(zip_path, files_dir)
            zip_path.unlink()
            info = PackageInfo(package_id, files, unpacked, zip_bytes, time.time())
            existing = self.get(package_id)
            if existing is not None:
                return existing, False
            (work / PACKAGE_FILE).write_text(json.dumps(asdict(info)))
            try:
                os.rename(work, self.root / package_id)  # atomic: the whole package or none
            except OSError:  # another upload of the same code won the race
                existing = self.get(package_id)
                if existing is None:
                    raise
                return existing, False
            return info, True
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _receive(self, body: Iterable[bytes], path: Path) -> int:
        size = 0
        with path.open("wb") as out:
            for chunk in body:
                size += len(chunk)
                if size > self.limits.max_zip_bytes:
                    raise PackageTooLarge(f"the zip is over {self.limits.max_zip_bytes} bytes")
                out.write(chunk)
        if size == 0:
            raise PackageInvalid("the body is empty: send the zip of your working dir (application/zip)")
        return size

    def _unpack(self, zip_path: Path, dest: Path) -> tuple[str, int, int]:
        """Unpack into ``dest`` with every check of the module doc; returns (id, files, bytes)."""
        try:
            archive = zipfile.ZipFile(zip_path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise PackageInvalid(f"not a zip file: {exc}") from None
        with archive:
            entries = archive.infolist()
            if len(entries) > self.limits.max_files:
                raise PackageTooLarge(f"the zip has {len(entries)} entries; at most {self.limits.max_files}")
            seen: set[PurePosixPath] = set()
            digests: list[tuple[str, bool, str]] = []
            unpacked = 0
            dest.mkdir()
            for info in entries:
                path = check_member_path(info.filename)
                kind = _kind(info)
                if kind not in ("dir", "file"):
                    raise PackageInvalid(f"zip entry {info.filename!r} is a {kind}; only files and dirs")
                if path in seen:
                    raise PackageInvalid(f"zip entry {info.filename!r} appears twice")
                seen.add(path)
                target = dest.joinpath(*path.parts)
                if kind == "dir":
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                executable = bool((info.external_attr >> 16) & 0o100)
                try:
                    with archive.open(info) as src, target.open("xb") as out:
                        digest, unpacked = self._copy(src, out, unpacked)
                except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError) as exc:
                    raise PackageInvalid(f"zip entry {info.filename!r} cannot be read: {exc}") from None
                target.chmod(0o700 if executable else 0o600)
                digests.append((path.as_posix(), executable, digest))
        if not digests:
            raise PackageInvalid("the zip holds no files")
        canonical = json.dumps(sorted(digests), separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest(), len(digests), unpacked

    def _copy(self, src: IO[bytes], out: IO[bytes], unpacked: int) -> tuple[str, int]:
        digest = hashlib.sha256()
        while chunk := src.read(COPY_CHUNK_BYTES):  # zipfile checks the CRC at the end
            unpacked += len(chunk)
            if unpacked > self.limits.max_unpacked_bytes:
                raise PackageTooLarge(f"the package unpacks to over {self.limits.max_unpacked_bytes} bytes")
            digest.update(chunk)
            out.write(chunk)
        return digest.hexdigest(), unpacked
