"""Where numba keeps tail_ray's compiled kernels: one directory, shared by every process.

Compiling the codec's kernels takes ~30 s of CPU on a 2-core machine. numba's own cache is
keyed by the absolute path of each source file, so every copy of the package compiles them
again: a Ray job ships the repository as its ``working_dir``, which Ray unpacks into a fresh
directory per cluster session, and each worker of the first job then compiled everything
(the first ``tail`` job of a fresh machine took 72 s against 30 s for ``none``).

This module registers a numba cache locator for tail_ray's own functions that does not care
where the package lives:

- freshness: a hash of every ``.py`` file of the package (not only the function's own file,
  as numba does): a kernel inlines helpers from other modules (``fixedsum.add_squares`` into
  the quantizer), and numba would not notice when only a helper changed. Any edit of the
  package makes every cached kernel stale, never wrong;
- directory: ``$NUMBA_CACHE_DIR`` if set, else ``~/.tail_ray/numba-cache`` (``cache_dir()``),
  then ``tail_ray-<hash>/<subpackage>``: the same for the editable install, a Ray
  working_dir copy and any worker on this machine (``tail-ray up`` exports the directory to
  the Ray head and so to every job); two versions of the package (two checkouts, a release
  and a working tree) keep their own entries instead of evicting each other's.
  ``prune_versions`` (run by ``tail-ray warmup``) keeps the few most recently used.

numba keys each entry further by signature, numba version, Python version and the target CPU
(name and features), so a directory shared between different CPUs (an NFS home) or different
numba releases holds separate entries and never hands one machine's code to another.

Functions of other packages keep numba's usual locators. If the cache directory cannot be
written, tail_ray's kernels fall back to them too (and compile per process at worst).
``tail-ray warmup`` (tail_ray/warmup.py) fills the cache once, up front.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from numba.core import caching

logger = logging.getLogger(__name__)

_PACKAGE = "tail_ray"
_PACKAGE_DIR = Path(__file__).resolve().parent


def cache_dir() -> Path:
    """The directory numba caches tail_ray's kernels under (created on first use)."""
    explicit = os.environ.get("NUMBA_CACHE_DIR")
    return Path(explicit).expanduser() if explicit else Path.home() / ".tail_ray" / "numba-cache"


def version_dir() -> Path:
    """This version's directory inside ``cache_dir()``."""
    return cache_dir() / f"{_PACKAGE}-{source_stamp()[:16]}"


def prune_versions(keep: int = 4) -> list[Path]:
    """Delete the cached kernels of all but the ``keep`` most recently written versions of the
    package (this one always stays); returns what was deleted. Deleting is always safe: a
    version that runs again compiles again."""
    root = cache_dir()
    current = version_dir()
    others = [p for p in root.glob(f"{_PACKAGE}-*") if p.is_dir() and p != current]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    for old in others[max(0, keep - 1) :]:
        shutil.rmtree(old, ignore_errors=True)
        removed.append(old)
    return removed


@functools.cache
def source_stamp() -> str:
    """sha256 over every .py file of the package (relative path and contents), hex."""
    h = hashlib.sha256()
    for path in sorted(_PACKAGE_DIR.rglob("*.py")):
        h.update(path.relative_to(_PACKAGE_DIR).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


class PackageCacheLocator(caching._CacheLocator):
    """numba cache locator for tail_ray's functions: see the module docstring."""

    def __init__(self, py_func: Any, subpackage: str) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(version_dir().joinpath(*subpackage.split(".")))

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        return source_stamp()

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> PackageCacheLocator | None:
        module = getattr(py_func, "__module__", "") or ""
        if module != _PACKAGE and not module.startswith(_PACKAGE + "."):
            return None
        self = cls(py_func, module.rpartition(".")[0] or _PACKAGE)
        try:
            self.ensure_cache_path()
        except OSError as exc:
            logger.debug("numba cache %s not writable (%s): numba's default locators", self._cache_path, exc)
            return None
        return self


def install() -> None:
    """Put the locator first in numba's list (idempotent). Runs when this module is imported,
    which tail_ray/__init__.py does before any kernel module: numba picks a function's locator
    when the function is decorated."""
    try:
        classes = caching.CacheImpl._locator_classes
    except AttributeError:  # pragma: no cover - a numba without this hook: its own locators
        logger.warning("this numba has no cache locator list: kernels cache per source path")
        return
    if PackageCacheLocator not in classes:
        classes.insert(0, PackageCacheLocator)


install()
