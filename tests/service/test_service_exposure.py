"""Least exposure (issue 17, findings 5 and 6), no Ray needed: the Host allow-list, reads that
need the token when a request comes in beyond loopback, the logs route that always needs it,
slow partial requests closed by the server (raw sockets against the real uvicorn server as
`tail-ray up` runs it), and owner-only files."""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from service_support import AUTH, LiveServer, make_settings

from service.main import create_app
from service.stack import secure_home
from service.storage import open_storage

HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    settings = make_settings(
        tmp_path / "db.sqlite",
        None,
        request_head_timeout_s=HEAD_TIMEOUT_S,
        body_read_timeout_s=BODY_TIMEOUT_S,
    )
    with LiveServer(settings) as live:
        yield live


def _connect(server: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed (monotonic)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic()


def _read_response(sock: socket.socket) -> bytes:
    """One HTTP response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return data


def test_host_header_must_be_an_allowed_name(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "db.sqlite", None)
    with TestClient(create_app(settings)) as client:
        rebound = client.get("/v1/jobs", headers={"Host": "attacker.example:8000"})
        assert rebound.status_code == 400 and rebound.json()["code"] == "host_not_allowed"
        assert "TAIL_RAY_ALLOWED_HOSTS" in rebound.json()["detail"]
        assert client.get("/", headers={"Host": "attacker.example"}).status_code == 400
        for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000"):
            assert client.get("/v1/jobs", headers={"Host": host}).status_code == 200, host
        # Probes answer any Host: kubelet sends the pod's IP.
        assert client.get("/healthz", headers={"Host": "10.1.2.3:8000"}).status_code == 200
    deployed = make_settings(tmp_path / "db.sqlite", None, allowed_hosts="tail-ray.example, testserver")
    with TestClient(create_app(deployed)) as client:
        assert client.get("/v1/jobs", headers={"Host": "tail-ray.example"}).status_code == 200
        assert client.get("/v1/jobs", headers={"Host": "127.0.0.1"}).status_code == 400


def test_reads_need_the_token_when_a_request_comes_in_beyond_loopback(tmp_path: Path) -> None:
    """The service answers a request that reached it on a network address (it is bound to
    one): every read needs the token there, the dashboard page itself excepted."""
    settings = make_settings(tmp_path / "db.sqlite", None, allowed_hosts="192.0.2.10")
    app = create_app(settings)
    with TestClient(app, base_url="http://192.0.2.10:8000") as remote:
        for path in ("/v1/jobs", "/v1/jobs/x/metrics/summary", "/metrics"):
            assert remote.get(path).status_code == 401, path
            assert remote.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 403, path
        assert remote.get("/v1/jobs", headers=AUTH).status_code == 200
        assert remote.get("/").status_code == 200  # the page asks for the token itself
    local = make_settings(tmp_path / "db.sqlite", None, allowed_hosts="127.0.0.1")
    with TestClient(create_app(local), base_url="http://127.0.0.1:8000") as client:
        assert client.get("/v1/jobs").status_code == 200  # the loopback dashboard stays open
        assert client.get("/v1/jobs/x/logs").status_code == 401  # the logs never are
    opted_out = make_settings(
        tmp_path / "db.sqlite", None, allowed_hosts="192.0.2.10", read_requires_token=False
    )
    with TestClient(create_app(opted_out), base_url="http://192.0.2.10:8000") as remote:
        assert remote.get("/v1/jobs").status_code == 200  # explicitly open (behind a proxy)


def test_slow_partial_request_heads_are_closed(server: LiveServer) -> None:
    """slowloris: a head that never completes, sent all at once, a byte at a time, or not at
    all, is closed after request_head_timeout_s; other clients are served meanwhile."""
    partial = _connect(server)
    partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    silent = _connect(server)
    trickle = _connect(server)
    t0 = time.monotonic()
    for byte in b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1":
        try:
            trickle.sendall(bytes([byte]))
        except OSError:
            break  # closed by the server: what this test wants
        if time.monotonic() - t0 > 4 * HEAD_TIMEOUT_S:
            break
        time.sleep(0.1)
    ok = _connect(server)
    ok.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    answer, _ = _read_until_closed(ok)
    assert answer.startswith(b"HTTP/1.1 200")
    for sock in (partial, silent, trickle):
        with sock:
            data, closed_at = _read_until_closed(sock)  # raises socket.timeout if never closed
            assert data == b""
            assert closed_at - t0 < HEAD_TIMEOUT_S + 3.0
    # A complete head still gets its full time to be answered (and a keep-alive connection
    # is reusable): two requests on one connection.
    with _connect(server) as again:
        for _ in range(2):
            again.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _read_response(again).startswith(b"HTTP/1.1 200")
            time.sleep(HEAD_TIMEOUT_S * 1.5)  # idle between requests: not a head deadline


def test_a_stalled_body_gets_408_and_the_connection_closes(server: LiveServer) -> None:
    with _connect(server) as sock:
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Authorization: {AUTH['Authorization']}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"name": '
        )
        t0 = time.monotonic()
        data, closed_at = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"stalled" in data
    assert closed_at - t0 < BODY_TIMEOUT_S + 3.0


def test_files_are_owner_only(tmp_path: Path) -> None:
    db = tmp_path / "new" / "service.sqlite"
    with open_storage(db) as store:
        store.insert_job(job_id="j", name="j", source="api", status="PENDING", entrypoint="e", spec=None)
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    # ~/.tail_ray as an older version left it: 0755, files 0644.
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    (home / "service.log").write_text("x")
    os.chmod(home / "service.log", 0o644)
    secure_home(home)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "service.log").stat().st_mode) == 0o600


@pytest.mark.parametrize(
    "headers",
    [{"Host": "127.0.0.1"}, {"Host": "evil.example"}],
    ids=["no-token", "host-not-allowed"],
)
def test_an_answer_before_the_body_is_read_keeps_the_connection_usable_or_says_close(
    server: LiveServer, headers: dict[str, str]
) -> None:
    """A request answered early (401 with no token, 400 for a Host not on the list) must leave
    the client a usable connection: either the server read the body and the connection serves
    the next request, or the answer says ``Connection: close``. Otherwise a client that reuses
    the connection gets a reset (seen in the API fuzz test)."""
    body = b'{"name": "x", "steps": 5}'
    with _connect(server) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(
            f"POST /v1/jobs HTTP/1.1\r\n{head}Content-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:5]  # the rest comes later: an early answer goes out while it is unread
        )
        if headers["Host"] == "evil.example":  # the Host check answers without reading on
            response = _read_response(sock)
            header_lines = response.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
            assert response.split()[1] == b"400", response[:200]
            assert b"connection: close" in header_lines, header_lines
            return
        time.sleep(0.2)  # the token check reads the body first (well within its read timeout)
        sock.sendall(body[5:])
        response = _read_response(sock)
        assert response.split()[1] == b"401", response[:200]
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200"), "the kept connection was not usable"
