"""Per-layer bits over steps (``GET /v1/jobs/{id}/metrics/layers/bits``): the windows storage
cuts on both backends (a SQLite file, a real PostgreSQL server) against a recomputation from
the records sent, the bound on their number, hostile steps, and the route (cache, 4xx)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient
from service_support import AUTH, LAYERS, make_settings, step_records

from service.main import create_app
from service.storage import IngestBatch, Storage, open_storage
from service.storage.layer_bits import window_width

JOB = "bits-job"


LOWRANK_LAYER = LAYERS[-1]


def _records(steps: range) -> list[dict[str, Any]]:
    """Two ranks' records; bits differ by layer and step (service_support's pattern), and rank 1
    sends one bit more than rank 0 on fc1.weight at odd steps (ranks decide independently).
    The last layer goes as rank-4 factors (their 8 bits) from step 6 on, and on rank 0 alone at
    step 3: a window can be all, some or none low-rank."""
    out = []
    for step in steps:
        for rec in step_records(JOB, step, ranks=2):
            if rec["type"] == "layer" and rec["layer"] == "fc1.weight" and rec["rank"] == 1 and step % 2:
                rec = {**rec, "bits": rec["bits"] + 1}
            lowrank = step >= 6 or (step, rec["rank"]) == (3, 0)
            if rec["type"] == "layer" and rec["layer"] == LOWRANK_LAYER and lowrank:
                rec = {**rec, "bits": 8, "code": "lowrank-r4"}
            out.append(rec)
    return out


def _ingest(store: Storage, records: list[dict[str, Any]]) -> None:
    first = store.cursor(JOB) + 1
    numbered = [{"seq": first + i, **r} for i, r in enumerate(records)]
    store.ingest(JOB, IngestBatch(numbered, numbered[-1]["seq"]))


def _expected(records: list[dict[str, Any]], width: int) -> dict[str, dict[str, list[Any]]]:
    """The windows recomputed in Python from the records sent."""
    windows: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in records:
        if r["type"] == "layer":
            windows.setdefault(r["layer"], {}).setdefault(max(r["step"], 0) // width, []).append(r)
    out = {}
    for layer, by_window in windows.items():
        cells = [by_window[k] for k in sorted(by_window)]
        out[layer] = {
            "steps": [max(r["step"] for r in c) for c in cells],
            "bits": [sum(r["bits"] for r in c) / len(c) for c in cells],
            "min_bits": [min(r["bits"] for r in c) for c in cells],
            "max_bits": [max(r["bits"] for r in c) for c in cells],
            "lowrank_share": [sum(r["code"].startswith("lowrank-") for r in c) / len(c) for c in cells],
        }
    return out


@pytest.fixture
def store(storage_url: str) -> Any:
    s = open_storage(storage_url)
    s.insert_job(job_id=JOB, name="bits", source="api", status="RUNNING", entrypoint="x", spec=None)
    yield s
    s.close()


def test_no_records_yet_is_an_empty_history(store: Storage) -> None:
    empty = {"first_step": None, "last_step": None, "step_width": 1, "layers": []}
    assert store.layer_bits(JOB, 200) == empty


def test_every_step_is_its_own_window_while_they_fit(store: Storage) -> None:
    sent = _records(range(10))
    _ingest(store, sent[: len(sent) // 2])  # two transactions: the history spans both
    _ingest(store, sent[len(sent) // 2 :])
    got = store.layer_bits(JOB, 200)
    assert (got["first_step"], got["last_step"], got["step_width"]) == (0, 9, 1)
    assert [s["layer"] for s in got["layers"]] == list(LAYERS)  # the model's order
    expected = _expected(sent, 1)
    for series in got["layers"]:
        want = expected[series["layer"]]
        assert series["steps"] == list(range(10))
        assert series["bits"] == pytest.approx(want["bits"])
        assert series["min_bits"] == want["min_bits"] and series["max_bits"] == want["max_bits"]
        assert series["lowrank_share"] == pytest.approx(want["lowrank_share"])
        assert series["numel"] == 1000 * (LAYERS.index(series["layer"]) + 1)
    # What the dashboard shows: bits differ across layers at one step, and over steps per layer.
    assert len({s["bits"][0] for s in got["layers"]}) == len(LAYERS)
    assert all(len(set(s["bits"])) > 1 for s in got["layers"])
    fc1 = next(s for s in got["layers"] if s["layer"] == "fc1.weight")
    assert [hi - lo for lo, hi in zip(fc1["min_bits"], fc1["max_bits"], strict=True)] == [0, 1] * 5
    # The kind, per step: quantized, one rank of two low-rank at step 3, both from step 6.
    low = next(s for s in got["layers"] if s["layer"] == LOWRANK_LAYER)
    assert low["lowrank_share"] == [0, 0, 0, 0.5, 0, 0, 1, 1, 1, 1]
    assert all(share == 0 for s in got["layers"] if s is not low for share in s["lowrank_share"])


@pytest.mark.parametrize("max_points", [2, 3, 4, 7])
def test_longer_runs_are_cut_into_at_most_max_points_windows(store: Storage, max_points: int) -> None:
    sent = _records(range(3, 40))  # a job whose metrics start late (retention, a resumed run)
    _ingest(store, sent)
    got = store.layer_bits(JOB, max_points)
    width = got["step_width"]
    assert width == window_width(3, 39, max_points) > 1
    expected = _expected(sent, width)
    for series in got["layers"]:
        want = expected[series["layer"]]
        assert 2 <= len(series["steps"]) <= max_points
        assert series["steps"] == want["steps"] and series["steps"][-1] == 39
        assert series["bits"] == pytest.approx(want["bits"])
        assert series["min_bits"] == want["min_bits"] and series["max_bits"] == want["max_bits"]
        assert series["lowrank_share"] == pytest.approx(want["lowrank_share"])


def test_hostile_steps_neither_overflow_nor_exceed_max_points(store: Storage) -> None:
    """Records accept any 64-bit step: the extremes must not overflow the window arithmetic
    (PostgreSQL raises on BIGINT overflow) nor make more windows than asked for."""
    extremes = [-(2**63), -5, 0, 7, 2**62, 2**63 - 1]
    sent = [r for step in extremes for r in step_records(JOB, step, ranks=1)]
    _ingest(store, sent)
    for max_points in (2, 3, 200):
        got = store.layer_bits(JOB, max_points)
        assert (got["first_step"], got["last_step"]) == (-(2**63), 2**63 - 1)
        expected = _expected(sent, got["step_width"])
        for series in got["layers"]:
            assert 1 <= len(series["steps"]) <= max_points
            assert series["steps"] == expected[series["layer"]]["steps"]
            assert series["min_bits"] == expected[series["layer"]]["min_bits"]


def test_window_width_bounds_the_windows_for_every_range() -> None:
    for lo, hi, max_points in itertools.product(range(0, 30, 3), range(0, 90, 7), range(2, 12)):
        if hi < lo:
            continue
        width = window_width(lo, hi, max_points)
        assert len({step // width for step in range(lo, hi + 1)}) <= max_points
        if hi - lo + 1 <= max_points:
            assert width == 1  # every step its own window while they fit
    assert window_width(0, 2**63 - 1, 2) == 2**63 - 1  # capped at BIGINT: windows 0 and 1
    assert window_width(-(2**63), -1, 5) == 1  # negative steps all count as step 0
    with pytest.raises(ValueError, match="max_points must be >= 2"):
        window_width(0, 10, 1)


def test_the_route_serves_the_history_through_the_cache_and_names_bad_fields(storage_url: str) -> None:
    with open_storage(storage_url) as store:
        store.insert_job(job_id=JOB, name="bits", source="api", status="RUNNING", entrypoint="x", spec=None)
        sent = _records(range(12))
        _ingest(store, sent)
        with TestClient(create_app(make_settings(storage_url, None))) as client:
            url = f"/v1/jobs/{JOB}/metrics/layers/bits"
            resp = client.get(url, params={"max_points": 5}, headers=AUTH)
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["job_id"] == JOB and body["max_points"] == 5
            assert body["step_width"] == math.ceil(12 / 4)
            assert [s["layer"] for s in body["layers"]] == list(LAYERS)
            want = _expected(sent, body["step_width"])
            assert {s["layer"]: s["max_bits"] for s in body["layers"]} == {
                k: v["max_bits"] for k, v in want.items()
            }
            for series in body["layers"]:
                assert series["lowrank_share"] == pytest.approx(want[series["layer"]]["lowrank_share"])
            assert any(0 < share < 1 for share in body["layers"][-1]["lowrank_share"])  # the window of step 3
            cache = client.app.state.read_cache
            hits = cache.hits
            assert client.get(url, params={"max_points": 5}, headers=AUTH).json() == body
            assert cache.hits == hits + 1  # unchanged ingest version: served from the cache
            _ingest(store, _records(range(12, 13)))  # a new step: the cache must not serve stale
            after = client.get(url, params={"max_points": 5}, headers=AUTH).json()
            assert after["last_step"] == 12 and after["layers"][0]["steps"][-1] == 12
            default = client.get(url, headers=AUTH).json()
            assert default["max_points"] == 200 and default["step_width"] == 1
            assert len(default["layers"][0]["steps"]) == 13

            for bad in ("1", "0", "2001", "many"):
                resp = client.get(url, params={"max_points": bad}, headers=AUTH)
                assert resp.status_code == 422, resp.text
                locs = {str(part) for err in resp.json()["detail"] for part in err["loc"]}
                assert "max_points" in locs, resp.text
            assert client.get("/v1/jobs/no-such-job/metrics/layers/bits", headers=AUTH).status_code == 404
