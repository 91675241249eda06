"""The metric read routes' cache: identical answers to uncached reads, and never stale after
an ingest (or a drain) changes the job."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient
from service_support import make_settings, step_records

from service.main import create_app
from service.read_cache import ReadCache
from service.schemas import LayerLatest, MetricsSummary, StepPoint
from service.storage import IngestBatch, Storage, open_storage


def _ingest_step(store: Storage, step: int, ratio_scale: float = 1.0) -> None:
    first = store.cursor("j1") + 1
    recs = [{"seq": first + i, **r} for i, r in enumerate(step_records("j1", step, ratio_scale=ratio_scale))]
    store.ingest("j1", IngestBatch(recs, recs[-1]["seq"]))


def _uncached(store: Storage) -> dict[str, object]:
    return {
        "summary": MetricsSummary(**store.summary("j1")).model_dump(mode="json"),
        "layers": [LayerLatest(**r).model_dump(mode="json") for r in store.latest_layers("j1")],
        "steps": [StepPoint(**r).model_dump(mode="json") for r in store.steps("j1", -1, 500)],
    }


def test_cached_reads_follow_every_ingest_and_the_drain(storage_url: str) -> None:
    db = storage_url
    store = open_storage(db)
    store.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    with TestClient(create_app(make_settings(db, None))) as client:
        base = "/v1/jobs/j1/metrics"

        def served() -> dict[str, object]:
            return {
                "summary": client.get(f"{base}/summary").json(),
                "layers": client.get(f"{base}/layers").json(),
                "steps": client.get(f"{base}/steps").json()["items"],
            }

        assert served() == _uncached(store)  # no records yet
        for step in range(3):
            _ingest_step(store, step, ratio_scale=1 + step)
            first, again = served(), served()  # the second read is a cache hit
            assert first == again == _uncached(store)
            assert first["summary"]["last_step"] == step and first["layers"][0]["step"] == step
        _ingest_step(store, 2, ratio_scale=5)  # a re-run step replaces the older records
        assert served() == _uncached(store)
        store.mark_drained("j1")
        assert client.get(f"{base}/summary").json()["ingest"]["drained"] is True
        cache = client.app.state.read_cache
        assert cache.hits >= 9 and cache.misses >= 15
    store.close()


def _read_while_the_build_waits(read: Callable[[], object], readers: int, gate: threading.Event) -> None:
    """``readers`` threads run ``read`` while the build blocks on ``gate``; then it is let go."""
    threads = [threading.Thread(target=read) for _ in range(readers)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(5)


def test_readers_of_a_new_version_share_one_build_and_its_error() -> None:
    """Single flight: a hundred dashboards reading right after an ingest commit run the query
    once; a failed build fails every reader that waited for it, and the next read retries."""
    cache, calls, gate = ReadCache(), [], threading.Event()

    def build() -> str:
        calls.append(1)
        gate.wait(5)  # slow enough that every reader arrives while it runs
        return "value"

    results: list[str] = []
    _read_while_the_build_waits(lambda: results.append(cache.get("k", 1, build)), 20, gate)
    assert results == ["value"] * 20 and len(calls) == 1
    assert (cache.misses, cache.hits) == (1, 19)

    def failing() -> str:
        gate.wait(5)
        raise RuntimeError("database restarting")

    gate.clear()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            cache.get("k", 2, failing)
        except RuntimeError as exc:
            errors.append(exc)

    _read_while_the_build_waits(read, 5, gate)
    assert len(errors) == 5
    assert cache.get("k", 2, lambda: "recovered") == "recovered"
    with pytest.raises(RuntimeError):
        cache.get("k", 3, failing)


def test_reads_may_be_as_old_as_read_max_staleness_s_and_no_older(storage_url: str) -> None:
    """With ``read_max_staleness_s`` a REST read within the window is served from the last
    result without asking the database (the load test's 100 dashboards); once the window
    has passed it shows the newest commit. The stream still reads exact versions."""
    store = open_storage(storage_url)
    store.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    _ingest_step(store, 0)
    window_s = 1.0
    with TestClient(create_app(make_settings(storage_url, None, read_max_staleness_s=window_s))) as client:
        base = "/v1/jobs/j1/metrics"
        before = time.monotonic()
        first = client.get(f"{base}/summary").json()
        assert first["last_step"] == 0
        _ingest_step(store, 1)
        if time.monotonic() - before < window_s * 0.8:  # a slow machine may already be past it
            assert client.get(f"{base}/summary").json() == first  # young enough: not re-read
        time.sleep(window_s)
        assert client.get(f"{base}/summary").json()["last_step"] == 1
        assert client.get(f"{base}/layers").json()[0]["step"] == 1
    store.close()


def test_recent_answers_only_within_max_age() -> None:
    from service.read_cache import MISS

    cache = ReadCache(max_age_s=0.3)
    assert cache.recent("k") is MISS
    assert cache.get("k", 1, lambda: "v1") == "v1"
    assert cache.recent("k") == "v1"
    time.sleep(0.35)
    assert cache.recent("k") is MISS
    assert ReadCache(max_age_s=0.0).recent("k") is MISS


def test_metric_reads_take_the_job_row_from_the_window_but_never_a_404(storage_url: str) -> None:
    """Within ``read_max_staleness_s`` the metric reads take the job row from the cache too (so
    a cached answer needs no database and no thread at all); a job that was not there is looked
    up again on the next read, and the job routes stay exact."""
    store = open_storage(storage_url)
    store.insert_job(job_id="j1", name="j1", source="api", status="RUNNING", entrypoint="x", spec=None)
    _ingest_step(store, 0)
    with TestClient(create_app(make_settings(storage_url, None, read_max_staleness_s=60.0))) as client:
        storage = client.app.state.storage
        looked_up: list[str] = []
        real_get_job = storage.get_job

        def counting_get_job(job_id: str) -> object:
            looked_up.append(job_id)
            return real_get_job(job_id)

        storage.get_job = counting_get_job  # a spy on the real storage: counts, then reads
        for route in ("summary", "layers", "steps?after_step=-1&limit=500", "summary"):
            assert client.get(f"/v1/jobs/j1/metrics/{route}").status_code == 200
        assert looked_up == ["j1"]  # the first read; the other three within the window

        assert client.get("/v1/jobs/j2/metrics/summary").status_code == 404
        store.insert_job(job_id="j2", name="j2", source="api", status="RUNNING", entrypoint="x", spec=None)
        assert client.get("/v1/jobs/j2/metrics/summary").status_code == 200  # the 404 was not kept

        store.update_job_status("j1", "FAILED", message="stopped by the test")
        assert client.get("/v1/jobs/j1").json()["status"] == "FAILED"  # exact: load_job
    store.close()


def test_a_result_past_half_its_age_is_served_at_once_and_refreshed_once_behind() -> None:
    """Refresh ahead: reads of a result older than half of ``max_age_s`` get it without
    waiting, one refresh runs on the cache's thread (however many reads came), its result
    replaces the old one; a failed refresh is logged and the next read tries again."""
    from service.read_cache import MISS

    cache = ReadCache(max_age_s=2.0)
    cache.get("k", 1, lambda: "v1")
    started: list[str] = []
    gate = threading.Event()

    def refresh() -> None:
        started.append(threading.current_thread().name)
        assert gate.wait(10)
        cache.get("k", 2, lambda: "v2", versioned_at=time.monotonic())

    assert cache.recent("k", refresh=refresh) == "v1"
    time.sleep(0.2)
    assert started == []  # young: no refresh yet
    time.sleep(1.0)  # past half of max_age_s (1 s), well within it
    assert [cache.recent("k", refresh=refresh) for _ in range(5)] == ["v1"] * 5
    gate.set()
    deadline = time.monotonic() + 10
    while cache.recent("k") != "v2" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cache.recent("k") == "v2"
    assert len(started) == 1 and started[0].startswith("read-refresh")

    failures: list[int] = []

    def failing() -> None:
        failures.append(1)
        raise RuntimeError("database gone")

    stale = ReadCache(max_age_s=2.0)
    stale.get("k", 1, lambda: "v1", versioned_at=time.monotonic() - 1.05)  # past half already
    assert stale.recent("k", refresh=failing) == "v1"
    deadline = time.monotonic() + 10
    while len(failures) < 2 and time.monotonic() < deadline:
        stale.recent("k", refresh=failing)  # once the failed refresh is over, a read starts another
        time.sleep(0.02)
    assert len(failures) >= 2
    cache.close()
    stale.close()
    time.sleep(1.1)  # "v2" is past half its age again
    assert cache.recent("k", refresh=refresh) in ("v2", MISS)  # closed: serves, starts nothing
    assert len(started) == 1
