"""`tail-ray submit --working-dir DIR -- python my_train.py ...`: the client side.

The directory is zipped in a canonical form (sorted paths, fixed timestamps; caches, virtual
environments and VCS data left out), so uploading the same code twice gives the same bytes;
the service keys packages by their files' content anyway. The command after ``--`` becomes
the job's ``entrypoint``: a leading interpreter is dropped (the service runs its own job
interpreter), ``-m module`` stays a module, a script is taken relative to DIR.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from pathlib import Path
from typing import Any

from service.client import CliError

EXCLUDED_DIRS = frozenset(
    {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache",
     "node_modules", ".ipynb_checkpoints", ".tox"}
)  # fmt: skip
EXCLUDED_SUFFIXES = (".pyc", ".pyo")
FIXED_DATE = (1980, 1, 1, 0, 0, 0)
_INTERPRETER = re.compile(r"^(?:.*/)?python(?:\d+(?:\.\d+)?)?$")


def zip_directory(directory: Path) -> tuple[bytes, int]:
    """(the zip, how many files) of ``directory``, canonical (see the module doc)."""
    if not directory.is_dir():
        raise CliError(f"--working-dir {directory}: not a directory")
    files: list[Path] = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        files += [Path(root) / n for n in names if not n.endswith(EXCLUDED_SUFFIXES)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(files, key=lambda p: p.relative_to(directory).as_posix()):
            if not path.is_file():  # a dangling symlink, a socket: nothing a job could use
                continue
            info = zipfile.ZipInfo(path.relative_to(directory).as_posix(), FIXED_DATE)
            info.external_attr = (0o755 if os.access(path, os.X_OK) else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, path.read_bytes())
    return buf.getvalue(), len(files)


def entrypoint_from_command(command: list[str], working_dir: Path | None) -> dict[str, Any]:
    """``python my_train.py --steps 3`` -> {"script": "my_train.py", "args": ["--steps", "3"]}."""
    args = list(command)
    if args and _INTERPRETER.match(args[0]):
        args = args[1:]
    if not args:
        raise CliError("give the command after --, e.g. `-- python my_train.py --steps 100`")
    if args[0] == "-m":
        if len(args) < 2:
            raise CliError("`-m` needs a module name")
        return {"module": args[1], "args": args[2:]}
    script = Path(args[0])
    if working_dir is not None and not (working_dir / script).is_file():
        resolved = script.resolve()
        if resolved.is_file() and resolved.is_relative_to(working_dir.resolve()):
            script = resolved.relative_to(working_dir.resolve())
        else:
            raise CliError(f"{args[0]} is not a file in --working-dir {working_dir}")
    return {"script": script.as_posix(), "args": args[1:]}
