"""Zero set-up token (issue 10, finding 1): on an empty HOME the launcher makes Ray's token with
Ray's own generator, owner-only, once, and never prints it; a token Ray can already find (env
or file) is left alone. Each case runs in a fresh interpreter with its own empty HOME, because
Ray caches the token it loaded."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

from service.settings import REPO_ROOT

ENSURE_TWICE = "from service.ray_head import ensure_ray_token; print(ensure_ray_token(), ensure_ray_token())"


def _run(home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    return subprocess.run(
        [sys.executable, "-c", ENSURE_TWICE],
        cwd=REPO_ROOT,
        env={**base, "HOME": str(home), "RAY_AUTH_MODE": "token", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_an_empty_home_gets_a_private_token_once(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.stdout.split() == ["True", "False"]  # made once, then found
    token_file = tmp_path / ".ray" / "auth_token"
    token = token_file.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)  # Ray's generator: 256 random bits, hex
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
    assert token not in done.stdout + done.stderr


def test_a_token_ray_can_already_find_is_left_alone(tmp_path: Path) -> None:
    from_env = _run(tmp_path / "env", RAY_AUTH_TOKEN="a" * 64)
    assert from_env.stdout.split() == ["False", "False"]
    assert not (tmp_path / "env" / ".ray").exists()
    existing = tmp_path / "file" / ".ray" / "auth_token"
    existing.parent.mkdir(parents=True)
    existing.write_text("b" * 64)
    assert _run(tmp_path / "file").stdout.split() == ["False", "False"]
    assert existing.read_text() == "b" * 64
