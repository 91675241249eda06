"""Where a job writes its results (--json, --plot): a path made ready when the flags are read.

A benchmark runs for minutes before it writes anything. A folder that does not exist yet
(`runs/` on a fresh clone) or cannot be written must fail the command line at once, not lose
the run at its last line.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def output_file(value: str) -> Path:
    """argparse ``type=``: the file's path, with its folder made now; exits 2 saying what to fix."""
    path = Path(value).expanduser()
    if not value or path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a folder, not a file: give a file path inside it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a folder should be, a read-only mount, ...
        raise argparse.ArgumentTypeError(
            f"cannot make the folder {str(path.parent)!r}: {exc.strerror or exc}"
        ) from exc
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in the folder {str(path.parent)!r}")
    return path
