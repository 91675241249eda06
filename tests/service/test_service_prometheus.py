"""/metrics as a scraper reads it: prometheus_client's own parsers accept both formats the route
serves (Prometheus text 0.0.4, and OpenMetrics when Accept asks for it), the values are the
stored figures, hostile label values survive escaping, and the cardinality caps hold. No Ray:
the jobs and their metrics are written through Storage, as the ingester writes them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus
from service_support import AUTH, make_settings, step_records

from service.main import create_app
from service.storage import IngestBatch, Storage, open_storage

# A layer name with every character the text formats must escape in a label value.
ODD_LAYER = 'blocks.0."attn"\\proj\nweight'
LAYERS = ("fc1.weight", ODD_LAYER, "fc2.bias")
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _seed(store: Storage, job_id: str, steps: int) -> None:
    store.insert_job(job_id=job_id, name=job_id, source="api", status="RUNNING", entrypoint="x", spec=None)
    records = [r for step in range(steps) for r in step_records(job_id, step, layers=LAYERS)]
    for seq, rec in enumerate(records, start=1):
        rec["seq"] = seq
    store.ingest(job_id, IngestBatch(records=records, next_seq=len(records)))


def _samples(families: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families  # type: ignore[attr-defined]
        for s in family.samples
    }


@pytest.fixture
def scraped(storage_url: str) -> Iterator[tuple[Storage, dict[str, tuple[str, str]]]]:
    """(storage, {format: (content type, body)}) of one app over four jobs, capped at the newest
    two jobs and two layers each; on both backends."""
    db = storage_url
    store = open_storage(db)
    for i in range(4):
        _seed(store, f"job-{i}", steps=2 + i)
    settings = make_settings(db, None, prometheus_max_jobs=2, prometheus_max_layers=2)
    with TestClient(create_app(settings)) as client:
        text = client.get("/metrics", headers=AUTH)
        om = client.get("/metrics", headers={**AUTH, "Accept": "application/openmetrics-text"})
    assert text.status_code == om.status_code == 200
    yield (
        store,
        {
            "text": (text.headers["content-type"], text.text),
            "openmetrics": (om.headers["content-type"], om.text),
        },
    )
    store.close()


def test_both_formats_parse_and_carry_the_same_stored_figures(scraped) -> None:
    store, bodies = scraped
    text_type, text = bodies["text"]
    om_type, om = bodies["openmetrics"]
    assert text_type.startswith("text/plain; version=0.0.4")
    assert om_type == OPENMETRICS and om.rstrip().endswith("# EOF")
    from_text, from_om = _samples(parse_prometheus(text)), _samples(parse_openmetrics(om))
    assert from_text == from_om  # the same series and values, whichever format was asked for

    newest = [job.id for job in store.list_jobs(2, 0)[0]]
    assert newest == ["job-3", "job-2"]
    for job_id in newest:
        summary = store.summary(job_id)
        label = (("job_id", job_id),)
        assert from_text[("tail_ray_job_steps", label)] == summary["steps"]
        assert from_text[("tail_ray_job_raw_bytes_total", label)] == summary["raw_bytes"]
        assert from_text[("tail_ray_job_sent_bytes_total", label)] == summary["bytes_sent"]
        assert from_text[("tail_ray_job_ingested_records_total", label)] == summary["ingest"]["records"]
        for row in store.latest_layers(job_id)[:2]:
            layer = (("job_id", job_id), ("layer", row["layer"]))
            assert from_text[("tail_ray_layer_ratio", layer)] == pytest.approx(row["ratio"])
            assert from_text[("tail_ray_layer_bits", layer)] == pytest.approx(row["bits"])
    assert from_text[("tail_ray_jobs", (("status", "RUNNING"),))] == 4
    assert from_text[("tail_ray_ingest_up", ())] == 1.0  # no ingest pass has failed


def test_the_cardinality_caps_hold_and_odd_label_values_round_trip(scraped) -> None:
    store, bodies = scraped
    families = {f.name: f for f in parse_prometheus(bodies["text"][1])}
    job_ids = {s.labels["job_id"] for f in families.values() for s in f.samples if "job_id" in s.labels}
    assert job_ids == {"job-3", "job-2"}  # prometheus_max_jobs=2 of 4
    layers = [s.labels["layer"] for s in families["tail_ray_layer_ratio"].samples]
    assert len(layers) == 4  # prometheus_max_layers=2, for each of the two jobs
    assert ODD_LAYER in {row["layer"] for row in store.latest_layers("job-3")[:2]}
    assert ODD_LAYER in layers  # quotes, backslash and newline came back intact
    assert families["tail_ray_job_raw_bytes"].type == "counter"  # the library's _total handling
