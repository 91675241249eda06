"""Hostile input is a 4xx, always (issue 17, findings 3 and 4), on the real app and a real
SQLite file, no Ray: the job server URL points at nothing, so a spec that got past validation
answers 503 `ray_unavailable`, never 201.

Each test here reproduced a 500 (or a wrong 2xx) before its fix: NaN / Infinity in a job spec
(500 from inside the validation handler), a lone surrogate in a string (500), `Last-Event-ID:
--5` (500) or 32 digits (200, then a stream cut by SQLite's OverflowError), `"steps": true` /
`"steps": "40"` taken as numbers, and malformed JSON without a token answered 422 before 401.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from service_support import API_TOKEN, AUTH, LiveServer, make_settings, seed_finished_job

from service import cli
from service.job_yaml import load_job_yaml
from service.main import create_app
from service.routers.metrics import MAX_STEP
from service.schemas import JobCreate

JSON_TYPE = "application/json"
JSON = {"content-type": JSON_TYPE}
DONE_JOB = "tail-done0000000001"
STEPS = 3


def _strict_json(text: str) -> Any:
    """The body as standard JSON: NaN / Infinity literals are an error, not a float."""

    def refuse(name: str) -> None:
        raise AssertionError(f"response body holds the non-JSON literal {name}")

    return json.loads(text, parse_constant=refuse)


def _locs(resp: Any) -> set[str]:
    return {str(part) for err in resp.json()["detail"] for part in err["loc"]}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = make_settings(tmp_path / "db.sqlite", None)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        seed_finished_job(c.app.state.storage, DONE_JOB, STEPS)  # type: ignore[attr-defined]
        yield c


# ------------------------------------------------------------------ non-finite numbers (finding 3)
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"name": "x", "lr": NaN}', "lr"),
        ('{"name": "x", "lr": Infinity}', "lr"),
        ('{"momentum": -Infinity}', "momentum"),
        ('{"lr": 1e400}', "lr"),  # overflows to Infinity in the JSON parser
        ('{"cpus_per_worker": NaN}', "cpus_per_worker"),
        ('{"steps": NaN}', "steps"),
        ('{"compression": {"tau_min": NaN}}', "compression"),
        ('{"compression": {"bits": -Infinity}}', "compression"),
    ],
)
def test_non_finite_numbers_get_422_naming_the_field(client: TestClient, body: str, field: str) -> None:
    resp = client.post("/v1/jobs", content=body, headers={**AUTH, **JSON})
    assert resp.status_code == 422, resp.text
    payload = _strict_json(resp.text)
    assert payload["code"] == "invalid_request"
    assert field in _locs(resp)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"seed": ' + "9" * 40 + "}", "seed"),
        ('{"steps": -' + "9" * 400 + "}", "steps"),
        ('{"compression": {"seed": ' + "9" * 40 + "}}", "compression"),
        ('{"compression": {"bits": ' + str(2**53 + 1) + "}}", "compression"),
    ],
)
def test_huge_integers_get_422_naming_the_field(client: TestClient, body: str, field: str) -> None:
    resp = client.post("/v1/jobs", content=body, headers={**AUTH, **JSON})
    assert resp.status_code == 422, resp.text
    assert field in _locs(resp)
    _strict_json(resp.text)


def test_an_unparseable_body_says_why(client: TestClient) -> None:
    for body, reason in [
        (b"[" * 20_000, "recursion"),
        (b'{"name": "\xff"}', "utf-8"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "digits"),
    ]:
        resp = client.post("/v1/jobs", content=body, headers={**AUTH, **JSON})
        assert resp.status_code == 400 and resp.json()["code"] == "bad_request"
        assert reason in resp.json()["detail"], resp.text


# ------------------------------------------------------------------ strict types (finding 4)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", True),
        ("steps", "40"),
        ("steps", 40.0),
        ("min_workers", False),
        ("seed", "7"),
        ("batch_size", 32.5),
        ("lr", "0.1"),
        ("lr", True),
        ("cpus_per_worker", "1"),
        ("max_failures", None),
    ],
)
def test_numbers_are_strict(client: TestClient, field: str, value: Any) -> None:
    resp = client.post("/v1/jobs", json={"name": "strict", field: value}, headers=AUTH)
    assert resp.status_code == 422, resp.text
    assert field in _locs(resp)


def test_real_numbers_still_pass_and_an_int_is_a_float(client: TestClient) -> None:
    spec = JobCreate.model_validate({"lr": 1, "cpus_per_worker": 2, "steps": 40, "compression": {"bits": 4}})
    assert type(spec.lr) is float and spec.lr == 1.0 and spec.steps == 40
    assert spec.compression == {"bits": 4} and type(spec.compression["bits"]) is int
    resp = client.post("/v1/jobs", json={"name": "ok", "lr": 1, "steps": 40}, headers=AUTH)
    assert resp.status_code == 503 and resp.json()["code"] == "ray_unavailable", resp.text  # validated


def test_yaml_specs_keep_working_under_strict_numbers() -> None:
    spec = load_job_yaml("name: from-yaml\nlr: 1e-5\nsteps: 40\nmomentum: 0.5\ncompression:\n  bits: 4\n")
    job = JobCreate.model_validate(spec)
    assert job.lr == 1e-5 and job.steps == 40 and job.compression == {"bits": 4}
    with pytest.raises(ValidationError, match="steps"):
        JobCreate.model_validate(load_job_yaml('steps: "40"\n'))
    with pytest.raises(ValidationError, match="finite"):
        JobCreate.model_validate(load_job_yaml("lr: .nan\n"))


def test_cli_submit_sends_yaml_numbers_as_numbers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`tail-ray submit` against the live app: `lr: 1e-5` passes validation (503 from the absent
    Ray, not 422), a quoted "40" is rejected naming the field."""
    with LiveServer(make_settings(tmp_path / "db.sqlite", None)) as server:
        good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
        good.write_text("name: yaml-job\nlr: 1e-5\nsteps: 40\nweight_decay: 5e-4\n")
        bad.write_text('name: yaml-job\nsteps: "40"\n')
        base = ["--url", server.url, "--token", API_TOKEN, "submit"]
        assert cli.main([*base, str(good)]) == cli.EXIT_API
        assert "HTTP 503" in capsys.readouterr().err
        assert cli.main([*base, str(bad)]) == cli.EXIT_API
        err = capsys.readouterr().err
        assert "rejected the job spec" in err and "steps: Input should be a valid integer" in err


# ------------------------------------------------------------------ the error handlers themselves
@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        ('{"name": "\\ud800"}', "application/json", 422),  # a lone surrogate: not UTF-8 encodable
        ('{"\\udfff": 1}', "application/json", 422),  # ... in an unknown key (echoed in loc)
        ('{"seed": ' + "9" * 4000 + "}", "application/json", 422),  # a 13,000-bit integer
        ('{"seed": ' + "9" * 5000 + "}", "application/json", 400),  # past Python's 4300-digit parse limit
        ("[" * 20_000 + "]" * 20_000, "application/json", 400),  # nested past the parser's recursion limit
        (b'{"name": "\xff\xfe"}', "application/json", 400),  # not UTF-8
        ('{"name": "x"}', "text/plain", 422),  # not JSON: the raw bytes fail validation
        ("[1, 2, 3]", "application/json", 422),
        ('"a string"', "application/json", 422),
        ("null", "application/json", 422),
        ('{"name": "j\u00f6b-\u540d"}', "application/json", 422),  # unicode in a name
        (
            '{"compression": {' + ", ".join(f'"k{i}": {i}' for i in range(2000)) + "}}",
            "application/json",
            422,
        ),
        ('{"name": "' + "n" * 60_000 + '"}', "application/json", 422),
    ],
)
def test_error_bodies_are_bounded_strict_json_for_any_input(
    client: TestClient, body: str | bytes, content_type: str, status: int
) -> None:
    data = body.encode("utf-8", errors="surrogatepass") if isinstance(body, str) else body
    resp = client.post("/v1/jobs", content=data, headers={**AUTH, "content-type": content_type})
    assert resp.status_code == status, resp.text[:500]
    payload = _strict_json(resp.content.decode("utf-8"))  # strict UTF-8: raises on a raw surrogate
    assert isinstance(payload["code"], str) and payload["detail"]
    assert len(resp.content) < 16_384, "an error body echoes a bounded part of the input"


# ------------------------------------------------------------------ SSE cursors (finding 3)
@pytest.mark.parametrize(
    "value",
    [b"--5", b"9" * 32, str(MAX_STEP + 1).encode(), b"-2", b"abc", b"1.5", b" 5", b"+5", b"1e3", b"0x10",
     "\u0663".encode(),  # ARABIC-INDIC DIGIT THREE (UTF-8): int() reads it as 3
     b"\xb2"],  # SUPERSCRIPT TWO (Latin-1): str.isdigit() said yes, then int() raised -> 500
)  # fmt: skip
def test_bad_last_event_id_is_a_400_naming_the_header(client: TestClient, value: bytes) -> None:
    resp = client.get(f"/v1/jobs/{DONE_JOB}/metrics/stream", headers={"Last-Event-ID": value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "invalid_header" and "Last-Event-ID" in resp.json()["detail"]


def _step_ids(text: str) -> list[int]:
    return [int(line.removeprefix("id: ")) for line in text.splitlines() if line.startswith("id: ")]


@pytest.mark.parametrize(("value", "expected"), [(None, [0, 1, 2]), ("", [0, 1, 2]), ("-1", [0, 1, 2]),
                                                 ("0", [1, 2]), ("2", []), (str(MAX_STEP), [])])  # fmt: skip
def test_valid_last_event_id_resumes_the_stream(
    client: TestClient, value: str | None, expected: list[int]
) -> None:
    headers = {} if value is None else {"Last-Event-ID": value}
    resp = client.get(f"/v1/jobs/{DONE_JOB}/metrics/stream", headers=headers)
    assert resp.status_code == 200
    assert _step_ids(resp.text) == expected
    assert "event: end" in resp.text  # the stream ran to its end, not cut


@pytest.mark.parametrize(
    "query",
    [f"after_step={MAX_STEP + 1}", "after_step=-2", "after_step=" + "9" * 32, "after_step=1.5",
     "after_step=NaN", "limit=0", "limit=5001", "limit=1e3", "limit=true"],
)  # fmt: skip
def test_step_cursors_are_bounded_ints(client: TestClient, query: str) -> None:
    for route in ("steps", "stream"):
        resp = client.get(f"/v1/jobs/{DONE_JOB}/metrics/{route}?{query}")
        if route == "stream" and query.startswith("limit"):
            continue  # the stream has no limit
        assert resp.status_code == 422, (route, query, resp.text)
        assert query.split("=")[0] in _locs(resp)
    assert client.get(f"/v1/jobs/{DONE_JOB}/metrics/steps?after_step={MAX_STEP}").json()["items"] == []


@pytest.mark.parametrize("query", ["limit=0", "limit=201", "offset=-1", "offset=" + "9" * 30, "limit=NaN"])
def test_list_paging_is_bounded(client: TestClient, query: str) -> None:
    resp = client.get(f"/v1/jobs?{query}")
    assert resp.status_code == 422 and query.split("=")[0] in _locs(resp)


# ------------------------------------------------------------------ auth before the body (finding 6)
MUTATING = ("post", "put", "patch", "delete")


def _operations(client: TestClient) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, operation) for every operation the app publishes."""
    paths = client.get("/openapi.json").json()["paths"]
    return [(method, path, op) for path, ops in paths.items() for method, op in ops.items()]


def test_every_mutating_route_checks_the_token_before_reading_the_body(client: TestClient) -> None:
    mutating = [(m, p, op) for m, p, op in _operations(client) if m in MUTATING]
    assert {op["operationId"] for _, _, op in mutating} == {"create_job", "stop_job", "upload_package"}
    malformed = b'{"name": "x", "steps": '  # cut short: not JSON
    for method, template, op in mutating:
        path = template.replace("{job_id}", "no-such-job")
        anonymous = client.request(method, path, content=malformed, headers=JSON)
        assert anonymous.status_code == 401, (path, anonymous.text)
        assert anonymous.headers["www-authenticate"] == "Bearer"
        wrong = {"Authorization": f"Bearer {API_TOKEN}x", **JSON}
        assert client.request(method, path, content=malformed, headers=wrong).status_code == 403
        basic = {"Authorization": f"Basic {API_TOKEN}", **JSON}
        assert client.request(method, path, content=malformed, headers=basic).status_code == 401
        # With the token the same request gets as far as the body (or the job lookup).
        authed = client.request(method, path, content=malformed, headers={**AUTH, **JSON})
        if op["operationId"] == "upload_package":  # a zip body: the same bytes are no zip
            assert authed.status_code == 422 and authed.json()["code"] == "invalid_package"
        elif "requestBody" in op:
            assert authed.status_code == 422 and authed.json()["detail"][0]["type"] == "json_invalid"
        else:
            assert authed.status_code == 404 and authed.json()["code"] == "job_not_found"


def test_a_refused_body_is_read_within_the_size_limit(client: TestClient) -> None:
    """The 401 reads the body (bounded) so the connection stays usable; past the size limit
    the answer is 413, as for a caller with a token."""

    def chunks(total: int) -> Iterator[bytes]:  # no Content-Length: streamed chunked
        for _ in range(total // 1024):
            yield b" " * 1024

    small = client.post("/v1/jobs", content=chunks(8 * 1024), headers=JSON)
    assert small.status_code == 401
    huge = client.post("/v1/jobs", content=chunks(128 * 1024), headers=JSON)
    assert huge.status_code == 413 and huge.json()["code"] == "body_too_large"


# ------------------------------------------------------------------ paths and unknown jobs
def test_unknown_jobs_are_404_and_odd_ids_4xx_on_every_job_route(client: TestClient) -> None:
    job_ops = [(m, p) for m, p, _ in _operations(client) if "{job_id}" in p]
    assert len(job_ops) >= 7
    odd_ids = [
        "%00",
        "a%2Fb",
        "%C3%A9t%C3%A9",
        "a" * 129,
        "%F0%9F%92%A5",
        "a%20b",
        "%ED%A0%80",
        "%2E%2E",
        "%2E",
    ]
    for method, template in job_ops:
        missing = client.request(method, template.replace("{job_id}", "tail-0000000000000000"), headers=AUTH)
        assert missing.status_code == 404 and missing.json()["code"] == "job_not_found", template
        for job_id in odd_ids:
            resp = client.request(method, template.replace("{job_id}", job_id), headers=AUTH)
            assert 400 <= resp.status_code < 500, (template, job_id, resp.status_code, resp.text)
            _strict_json(resp.text)


def test_error_bodies_for_unknown_routes_and_methods_have_the_common_shape(client: TestClient) -> None:
    assert client.get("/v1/nothing-here").json()["code"] == "not_found"
    resp = client.put("/v1/jobs", headers=AUTH)
    assert resp.status_code == 405 and resp.json()["code"] == "method_not_allowed"
    assert "allow" in resp.headers
