"""Bad input at the REST boundary, no Ray needed (the job server URL points at nothing, so
anything that got past validation would be a 503, never a 201): oversize bodies (declared or
chunked) get 413, unknown fields and out-of-range limits get 422 naming the field, mutating
routes without or with a wrong token get 401/403, and the API token appears in no log record
and no response."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from service_support import API_TOKEN, AUTH, make_settings

from service.main import create_app

MAX_BODY_BYTES = 4096


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = make_settings(tmp_path / "db.sqlite", None, max_body_bytes=MAX_BODY_BYTES)
    with TestClient(create_app(settings)) as c:
        yield c


def test_oversize_bodies_get_413(client: TestClient) -> None:
    big = {"name": "x", "compression": {"k": "a" * MAX_BODY_BYTES}}
    declared = client.post("/v1/jobs", json=big, headers=AUTH)
    assert declared.status_code == 413 and declared.json()["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: streamed chunked
        yield b'{"name": "x", "compression": {"k": "'
        for _ in range(MAX_BODY_BYTES // 512 + 1):
            yield b"a" * 512
        yield b'"}}'

    chunked = client.post("/v1/jobs", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    # Just under the limit is read and validated as usual (and fails validation, not size).
    ok_size = client.post("/v1/jobs", json={"name": "x", "unknown": "a" * 100}, headers=AUTH)
    assert ok_size.status_code == 422


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"entrypoint": "bash -c evil"}, "entrypoint"),
        ({"runtime_env": {"pip": ["evil"]}}, "runtime_env"),
        ({"steps": 0}, "steps"),
        ({"steps": 1_000_001}, "steps"),
        ({"min_workers": 0}, "min_workers"),
        ({"max_workers": 65}, "max_workers"),
        ({"name": "a" * 65}, "name"),
        ({"name": "../etc/passwd"}, "name"),
        ({"name": "x; rm -rf /"}, "name"),
        ({"compression": {f"k{i}": 1 for i in range(17)}}, "compression"),
        ({"compression": {"Bad-Key": 1}}, "compression"),
        ({"compression": {"bits": "$(id)"}}, "compression"),
        ({"cpus_per_worker": 0}, "cpus_per_worker"),
        ({"lr": -1}, "lr"),
    ],
)  # fmt: skip
def test_unknown_fields_and_limits_get_422_naming_the_field(
    client: TestClient, body: dict, field: str
) -> None:
    resp = client.post("/v1/jobs", json=body, headers=AUTH)
    assert resp.status_code == 422, resp.text
    assert field in {str(part) for err in resp.json()["detail"] for part in err["loc"]}


def test_mutating_routes_without_or_with_a_wrong_token(client: TestClient) -> None:
    for path in ("/v1/jobs", "/v1/jobs/some-job/stop"):
        assert client.post(path, json={}).status_code == 401
        assert (
            client.post(path, json={}, headers={"Authorization": "Bearer wrong-token-0123456789"}).status_code
            == 403
        )
        assert client.post(path, json={}, headers={"Authorization": f"Basic {API_TOKEN}"}).status_code in (
            401,
            403,
        )
        assert (
            client.post(path, json={}, headers={"Authorization": f"Bearer {API_TOKEN}x"}).status_code == 403
        )


def test_the_api_token_is_never_logged_or_echoed(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    bodies = [
        client.post("/v1/jobs", json={"name": "tok"}, headers=AUTH).text,  # 503: no Ray behind
        client.post("/v1/jobs/x/stop", headers={"Authorization": f"Bearer {API_TOKEN}x"}).text,
        client.get("/readyz").text,
        client.get("/").text,
        client.get("/static/app.js").text,
        client.get("/openapi.json").text,
        client.get("/metrics").text,
    ]
    assert caplog.records, "nothing was logged: the check below would prove nothing"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert API_TOKEN not in logged
    assert all(API_TOKEN not in body for body in bodies)
