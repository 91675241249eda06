"""Fuzzing the whole published API: schemathesis 4 + Hypothesis against /openapi.json on the
live app (uvicorn, a real Ray head behind it, a real SQLite file). Every generated request
must get a status below 500, and every error a strict-JSON ``{code, detail}`` body.

Schemathesis' pytest plugin (``schemathesis.pytest.from_fixture`` + ``@schema.parametrize``)
broke on pytest 9 ("'Function' object has no attribute '_nodeid'") and then ran no case at
all; the test printed "0 cases ... no 5xx" and read like a pass. So the plugin is not used:
each operation's ``as_strategy()`` is drawn from inside a plain ``@given`` (public API in
every schemathesis 4.x), the test counts what it sent, and it FAILS when it sent fewer cases
than it asked for or missed any operation of the app.

On top of what schemathesis generates (valid and invalid values for every declared
parameter and body), each case may get what a schema cannot describe: a raw JSON body with
NaN / Infinity / 1e400 (standard JSON has none; Python's parser accepts them) or integers far
past 64 bits, a cut-off body, a foreign Content-Type, and hostile Last-Event-ID, Host and
Authorization headers. Half the cases that take a job id get a finished job with stored
metrics instead of a random id, so the routes run past their 404.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.result import Ok
from service_support import API_TOKEN, LiveServer, make_settings, ray_cluster, seed_finished_job

from service.storage import open_storage

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@schemathesis.serializer("application/zip")
def _zip_body(ctx: Any, value: Any) -> bytes:
    """The package upload's body as generated (bytes for a binary string): mostly no zip at all,
    which the route must refuse with a 4xx."""
    return value if isinstance(value, bytes) else str(value).encode("utf-8", errors="surrogatepass")


# The case budget: 1,020 requests, >= 1,000 as issue 18 asks, in ~30-60 s on the shared 2-core
# dev machine (a case costs ~10-50 ms: generation plus one loopback request; more for a
# create_job that Ray accepts, a real submission, ~15 per run). With the Ray head's start and
# stop the module stays under 90 s on 2 cores. create_job gets the most: its body is the
# richest input and the raw-body mutations (non-finite numbers, huge integers, cut bodies)
# apply to it alone. The three operations without parameters vary only by the hostile headers.
CASES_PER_OPERATION = 85
CASES_FOR = {"create_job": 220, "healthz": 40, "readyz": 40, "prometheus_metrics": 40}
MIN_TOTAL_CASES = 1_000

DONE_JOB = "tail-fuzzdone000000001"  # a finished, drained job with metrics for 3 steps
AUTH_VALUE = f"Bearer {API_TOKEN}"
NUMERIC_FIELDS = (
    "steps", "batch_size", "lr", "momentum", "weight_decay", "seed", "min_workers", "max_workers",
    "cpus_per_worker", "gpus_per_worker", "lr_drop_at", "lr_drop_factor", "checkpoint_every_steps",
    "metrics_every_steps", "max_failures",
)  # fmt: skip
NON_FINITE = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400")
EXTRAS = {
    "finished job id", "Authorization", "Last-Event-ID", "Host", "Content-Type", "non-finite body",
    "non-finite-setting body", "huge-int body", "cut body",
}  # fmt: skip


@dataclass
class FuzzLog:
    asked: dict[str, int] = field(default_factory=dict)
    elapsed_s: dict[str, float] = field(default_factory=dict)
    cases: collections.Counter[str] = field(default_factory=collections.Counter)
    statuses: dict[str, collections.Counter[int]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    extras: collections.Counter[str] = field(default_factory=collections.Counter)  # hostile additions sent
    server_errors: list[str] = field(default_factory=list)
    bad_error_bodies: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("openapi")
    # Jobs the fuzzer manages to submit run from an empty working dir: Ray takes them (the
    # real submission path) and their entrypoint exits at once instead of training.
    empty = tmp / "empty-working-dir"
    empty.mkdir()
    db_path = tmp / "db.sqlite"
    with open_storage(db_path) as store:
        seed_finished_job(store, DONE_JOB, steps=3)
    with ray_cluster(tmp, num_cpus=1) as head:
        app_settings = make_settings(db_path, head, job_working_dir=empty)
        with LiveServer(app_settings) as server:
            yield server.url


@pytest.fixture(scope="module")
def api_schema(live_url: str) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{live_url}/openapi.json")


def _operations(api_schema: schemathesis.BaseSchema) -> list[schemathesis.APIOperation]:
    operations = []
    for result in api_schema.get_all_operations():
        assert isinstance(result, Ok), f"schemathesis cannot test an operation: {result.err()}"
        operations.append(result.ok())
    return operations


def _operation_id(op: schemathesis.APIOperation) -> str:
    return str(op.definition.raw["operationId"])


def test_openapi_has_stable_operation_ids(api_schema: schemathesis.BaseSchema) -> None:
    assert {_operation_id(op) for op in _operations(api_schema)} == {
        "create_job", "list_jobs", "get_job", "stop_job", "get_job_logs", "get_layer_metrics",
        "get_layer_bits_history", "get_step_metrics", "get_metrics_summary", "stream_metrics",
        "prometheus_metrics", "healthz", "readyz", "upload_package", "get_package",
    }  # fmt: skip


# ------------------------------------------------------------------ hostile extras
# Latin-1 text for a header value (sent as bytes), no surrounding whitespace (which HTTP
# parsers strip anyway).
_LATIN1_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
).map(str.strip)
_AUTHORIZATION = st.sampled_from(
    [AUTH_VALUE] * 6
    + ["schemathesis", None, f"Bearer {API_TOKEN}x", f"Basic {API_TOKEN}", "Bearer", "Bearer " + "x" * 4096]
)
_LAST_EVENT_ID = st.one_of(
    st.none(),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.sampled_from(["--5", "9" * 32, "", "-1", "0", str(2**53), str(2**53 + 1), "\xb2", "1e3", "0x10"]),
    _LATIN1_TEXT,
)
_CONTENT_TYPE = st.sampled_from(
    [None] * 4
    + ["text/plain", "application/json; charset=latin-1", "application/merge-patch+json",
       "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/json;;;", "*/*"]
)  # fmt: skip


def _hosts(url: str) -> st.SearchStrategy[str | None]:
    hostport = url.removeprefix("http://")
    port = hostport.rsplit(":", 1)[1]
    return st.sampled_from(
        [None] * 4
        + [f"localhost:{port}", "evil.example", "127.0.0.1:1", f"[::1]:{port}", "h" * 300,
           f"{hostport}, evil.example", f"xn--80ak6aa92e.com:{port}", "127.0.0.1:99999"]
    )  # fmt: skip


@st.composite
def _raw_body(draw: st.DrawFn, body: Any) -> tuple[str, bytes]:
    """The generated body with a non-JSON number, a huge integer or a cut, as raw bytes."""
    spec = dict(body) if isinstance(body, dict) else {}
    kind = draw(st.sampled_from(["non-finite", "non-finite-setting", "huge-int", "cut"]))
    if kind == "non-finite":
        spec[draw(st.sampled_from(NUMERIC_FIELDS))] = "@@"
        text = json.dumps(spec).replace('"@@"', draw(st.sampled_from(NON_FINITE)))
    elif kind == "non-finite-setting":
        spec["compression"] = {draw(st.sampled_from(["bits", "tau_min", "density", "rank"])): "@@"}
        text = json.dumps(spec).replace('"@@"', draw(st.sampled_from(NON_FINITE)))
    elif kind == "huge-int":
        magnitude = draw(st.integers(min_value=2**63, max_value=10**1000))
        spec[draw(st.sampled_from(NUMERIC_FIELDS))] = draw(st.sampled_from([magnitude, -magnitude]))
        text = json.dumps(spec)
    else:
        text = json.dumps(spec)
        text = text[: draw(st.integers(min_value=0, max_value=max(0, len(text) - 1)))]
    return f"{kind} body", text.encode()


@st.composite
def _request(
    draw: st.DrawFn, op: schemathesis.APIOperation, strategies: dict[GenerationMode, Any], url: str
) -> dict[str, Any]:
    """The request for one fuzz case of ``op``: schemathesis' transport kwargs, plus
    ``content`` for a raw body and ``extras`` naming the hostile additions."""
    extras: list[str] = []
    case = draw(strategies[draw(st.sampled_from(sorted(strategies, key=lambda m: m.value)))])
    if "job_id" in (case.path_parameters or {}) and draw(st.booleans()):
        case.path_parameters["job_id"] = DONE_JOB
        extras.append("finished job id")
    kwargs: dict[str, Any] = case.as_transport_kwargs(base_url=url)
    headers: dict[str, str] = kwargs.setdefault("headers", {})
    auth = draw(_AUTHORIZATION)
    if auth != "schemathesis":  # else keep what schemathesis generated (maybe a bad one)
        headers.pop("Authorization", None)
        if auth is not None:
            headers["Authorization"] = auth
    if auth != AUTH_VALUE:
        extras.append("Authorization")
    for name, strategy in (("Last-Event-ID", _LAST_EVENT_ID), ("Host", _hosts(url))):
        value = draw(strategy)
        if value is not None:
            headers[name] = value
            extras.append(name)
    if op.get_request_payload_content_types():
        if "json" in kwargs and draw(st.integers(min_value=0, max_value=2)) == 0:
            kind, kwargs["content"] = draw(_raw_body(kwargs.pop("json")))
            headers["Content-Type"] = "application/json"
            extras.append(kind)
        content_type = draw(_CONTENT_TYPE)
        if content_type is not None:
            headers["Content-Type"] = content_type
            extras.append("Content-Type")
    kwargs["extras"] = extras
    return kwargs


def _has_inputs(op: schemathesis.APIOperation) -> bool:
    return any(True for _ in op.iter_parameters()) or bool(op.get_request_payload_content_types())


def _send(client: httpx.Client, kwargs: dict[str, Any]) -> httpx.Response:
    """Send schemathesis' transport kwargs (requests-style) with httpx. Header values go as
    Latin-1 bytes (httpx would encode a str as ASCII), without surrounding whitespace (h11
    refuses to send it, and a server strips it anyway: "Bearer " arrives as "Bearer")."""
    headers = {
        k: (v.encode("latin-1") if isinstance(v, str) else v).strip() for k, v in kwargs["headers"].items()
    }
    body: dict[str, Any] = {}
    raw = kwargs.get("content", kwargs.get("data"))
    if isinstance(raw, bytes | str):
        body["content"] = raw
    elif raw is not None:
        body["data"] = raw  # a form
    elif kwargs.get("json") is not None:
        body["json"] = kwargs["json"]
    return client.request(
        kwargs["method"], kwargs["url"], params=kwargs.get("params"), headers=headers,
        cookies=kwargs.get("cookies") or None, timeout=30, **body,
    )  # fmt: skip


def _fuzz(op: schemathesis.APIOperation, url: str, client: httpx.Client, log: FuzzLog) -> None:
    """Ask Hypothesis for ``CASES_FOR[op]`` generated requests and send them. A 5xx, a
    transport error or a malformed error body is recorded (not raised: no shrinking
    re-runs, an exact case count, and every problem in one report)."""
    name = _operation_id(op)
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if _has_inputs(op) else [])
    strategies = {mode: op.as_strategy(generation_mode=mode) for mode in modes}
    log.asked[name] = CASES_FOR.get(name, CASES_PER_OPERATION)

    @settings(
        max_examples=log.asked[name],
        deadline=None,
        derandomize=True,  # the same cases on every run: a failure reproduces
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(kwargs=_request(op, strategies, url))
    def one_case(kwargs: dict[str, Any]) -> None:
        log.cases[name] += 1
        log.extras.update(kwargs.pop("extras"))
        described = f"{name}: {kwargs['method']} {kwargs['url']} headers={kwargs.get('headers')} " + (
            f"body={str(kwargs.get('json', kwargs.get('content', kwargs.get('data'))))[:300]}"
        )
        try:
            resp = _send(client, kwargs)
        except httpx.HTTPError as exc:
            log.server_errors.append(f"{described} -> {type(exc).__name__}: {exc}")
            return
        log.statuses[name][resp.status_code] += 1
        if resp.status_code >= 500:
            log.server_errors.append(f"{described} -> {resp.status_code} {resp.text[:300]}")
        elif resp.status_code >= 400 and not _is_error_body(resp.content):
            log.bad_error_bodies.append(f"{described} -> {resp.status_code} {resp.text[:300]}")

    started = time.monotonic()
    one_case()
    log.elapsed_s[name] = time.monotonic() - started


def _is_error_body(content: bytes) -> bool:
    def refuse(name: str) -> None:
        raise ValueError(name)

    try:
        body = json.loads(content.decode("utf-8"), parse_constant=refuse)
    except ValueError:
        return False
    return isinstance(body, dict) and isinstance(body.get("code"), str) and "detail" in body


def test_no_server_errors(api_schema: schemathesis.BaseSchema, live_url: str) -> None:
    operations = _operations(api_schema)
    log = FuzzLog()
    started = time.monotonic()
    with httpx.Client() as client:
        for op in operations:
            _fuzz(op, live_url, client, log)
    elapsed_s = time.monotonic() - started
    total, asked = sum(log.cases.values()), sum(log.asked.values())
    for name in sorted(log.asked):
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(log.statuses[name].items()))
        print(
            f"  {name:<20} {log.cases[name]:>4} of {log.asked[name]:>4} cases "
            f"{log.elapsed_s[name]:5.1f} s  {statuses}"
        )
    print("  hostile additions: " + ", ".join(f"{k}: {n}" for k, n in sorted(log.extras.items())))
    print(
        f"API fuzz: {total} cases sent of {asked} asked, over {len(log.cases)} of {len(operations)} "
        f"operations, {len(log.server_errors)} 5xx or transport errors, {len(log.bad_error_bodies)} "
        f"malformed error bodies, {elapsed_s:.1f} s"
    )
    assert set(log.cases) == {_operation_id(op) for op in operations}, "an operation got no case"
    short = {name: log.cases[name] for name, n in log.asked.items() if log.cases[name] < n}
    assert not short, f"Hypothesis ran fewer cases than asked for: {short} (asked {log.asked})"
    assert total >= MIN_TOTAL_CASES, f"sent {total} cases, fewer than {MIN_TOTAL_CASES}"
    assert set(log.extras) == EXTRAS, f"hostile additions never sent: {EXTRAS - set(log.extras)}"
    assert not log.server_errors, "\n".join(log.server_errors[:20])
    assert not log.bad_error_bodies, "\n".join(log.bad_error_bodies[:20])
