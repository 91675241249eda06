"""The metric read routes' cache: identical answers to uncached reads, and never stale after
an ingest (or a drain) changes the job."""

from __future__ import annotations

from fastapi.testclient import TestClient
from service_support import make_settings, step_records

from service.main import create_app
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
