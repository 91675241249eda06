from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ray reads its auth mode when it is first imported; say token auth before any test imports it.
os.environ["RAY_AUTH_MODE"] = "token"
# service_support sits next to this file; make it importable however pytest is invoked.
sys.path.insert(0, str(Path(__file__).parent))

from jobs.local_postgres import LocalPostgres

BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[LocalPostgres]:
    """One real PostgreSQL server for the session (initdb + pg_ctl in a temp dir, free port);
    every test that uses it gets a database of its own (``storage_url``)."""
    with LocalPostgres() as server:
        yield server


@pytest.fixture(params=BACKENDS)
def storage_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database on each backend: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'db.sqlite'}"
    server: LocalPostgres = request.getfixturevalue("postgres_server")
    return server.create_database()
