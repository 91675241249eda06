"""The CLI's HTTP client of the service, and where `tail-ray up` leaves the URL and token for it.

The URL and API token come from --url/--token, else TAIL_RAY_URL/TAIL_RAY_API_TOKEN, else the
file `up` writes once its stack is up (``state_file()``: ~/.tail_ray/cli.json, mode 0600).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class CliError(Exception):
    """A message for the user; the CLI prints it and exits non-zero."""


def home_dir() -> Path:
    """tail-ray's own directory: TAIL_RAY_HOME, else ~/.tail_ray (read now, not at import)."""
    return Path(os.environ.get("TAIL_RAY_HOME") or Path.home() / ".tail_ray").expanduser()


def state_file() -> Path:
    return home_dir() / "cli.json"


def read_state() -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(state_file().read_text())
        if isinstance(state, dict):
            return state
    return {}


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as a new 0600 file, atomically (rename over the old one): it
    never exists with a wider mode, nor half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@dataclass
class Api:
    url: str
    token: str | None

    @classmethod
    def resolve(cls, url: str | None, token: str | None) -> Api:
        state = read_state()
        url = url or os.environ.get("TAIL_RAY_URL") or state.get("url") or DEFAULT_URL
        token = token or os.environ.get("TAIL_RAY_API_TOKEN") or state.get("token")
        return cls(url.rstrip("/"), token)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def request(
        self, method: str, path: str, extra_headers: dict[str, str] | None = None, **kwargs: Any
    ) -> Any:
        headers = {**self._headers(), **(extra_headers or {})}
        try:
            resp = httpx.request(method, self.url + path, headers=headers, timeout=120.0, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(
                f"cannot reach the service at {self.url} ({exc}); is `tail-ray up` running?"
            ) from None
        if resp.status_code == 422:
            detail = resp.json().get("detail")
            if isinstance(detail, list):
                lines = [f"  {'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in detail]
                raise CliError("the service rejected the job spec:\n" + "\n".join(lines))
        if resp.status_code >= 400:
            try:
                message = resp.json().get("detail", resp.text)
            except ValueError:
                message = resp.text
            raise CliError(f"{method} {path} -> HTTP {resp.status_code}: {message}")
        return resp.json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params or None)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, json=body)

    def post_zip(self, path: str, data: bytes) -> Any:
        return self.request("POST", path, content=data, extra_headers={"Content-Type": "application/zip"})

    def ready(self, timeout_s: float = 10.0) -> bool:
        """True when /readyz answers 200 (the database takes writes and Ray answers)."""
        try:
            return httpx.get(self.url + "/readyz", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False
