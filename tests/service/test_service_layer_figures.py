"""Per-layer figures through the API the dashboard reads, for every code: real compressors make
the metrics two workers would send, a real database stores them (a SQLite file and a PostgreSQL
server), and ``GET /v1/jobs/{id}/metrics/layers`` serves them (no Ray: records are ingested directly)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from service_support import AUTH, make_settings

from service.main import create_app
from service.storage import IngestBatch, open_storage
from tail_ray.compression import make_compressor
from tail_ray.metrics.records import LayerMetric

N = 20_000


def _digits_fc1(rng: np.random.Generator) -> np.ndarray:
    """Mostly zero, with one bucket of subnormal gradients: the layer that showed -25,165,823.6."""
    x = np.zeros(N, np.float32)
    x[rng.choice(N, 100, replace=False)] = rng.standard_normal(100)
    x[:512] = rng.standard_normal(512).astype(np.float32) * np.float32(1e-40)
    return x


# method, settings, {layer: (gradient, the code it must pick)}
CASES = [
    ("tail", {"candidate_bits": (4,)}, {
        "bias": (lambda r: r.standard_normal(100), "raw"),
        "pairs": (lambda r: r.standard_normal(N), "rans-pairs"),
        "fc1.weight": (_digits_fc1, "sparse-rans"),
    }),
    ("tail", {"candidate_bits": (8,)}, {
        "rans": (lambda r: r.standard_normal(N), "rans"),
        "bitpack": (lambda r: r.uniform(-1, 1, 5_000), "bitpack"),
    }),
    ("topk", {"density": 0.05}, {"topk": (lambda r: r.standard_normal(N), "sparse-pos")}),
    ("none", {}, {"none": (lambda r: r.standard_normal(N), "raw-none")}),
]  # fmt: skip


def _records(job_id: str, step: int, rank: int) -> list[dict[str, object]]:
    """The layer records one worker sends for one step (as tail_ray.runner.train_loop builds them)."""
    rng = np.random.default_rng(100 * step + rank)
    out = []
    for method, settings, layers in CASES:
        comp = make_compressor(method, **({**settings, "seed": rank} if method == "tail" else settings))
        comp.compress({n: torch.from_numpy(make(rng).astype(np.float32)) for n, (make, _) in layers.items()})
        for s in comp.last_stats:
            metric = LayerMetric(
                job_id=job_id, step=step, rank=rank, layer=s.layer, numel=s.numel, bits=s.bits,
                density=s.density, raw_bytes=s.raw_bytes, encoded_bytes=s.encoded_bytes, ratio=s.ratio,
                rel_error=s.rel_error, code=s.code,
            )  # fmt: skip
            out.append(metric.to_dict())
    return out


def test_layer_figures_through_the_api_for_every_code(storage_url: str) -> None:
    db = storage_url
    sent = [r for step in (0, 1) for rank in (0, 1) for r in _records("digits", step, rank)]
    with open_storage(db) as store:
        store.insert_job(
            job_id="digits", name="digits", source="api", status="RUNNING", entrypoint="x", spec=None
        )
        store.ingest("digits", IngestBatch([{"seq": i + 1, **r} for i, r in enumerate(sent)], len(sent)))

    with TestClient(create_app(make_settings(db, None))) as client:
        resp = client.get("/v1/jobs/digits/metrics/layers", headers=AUTH)
    assert resp.status_code == 200, resp.text
    served = {row["layer"]: row for row in resp.json()}
    expected_codes = {name: code for _, _, layers in CASES for name, (_, code) in layers.items()}
    assert served.keys() == expected_codes.keys()
    for name, row in served.items():
        newest = [r for r in sent if r["layer"] == name and r["step"] == 1]
        assert row["step"] == 1 and row["ranks"] == 2
        assert row["code"] == expected_codes[name].removesuffix("-none"), row
        assert row["density"] is not None and 0.0 <= row["density"] <= 1.0, row
        assert row["density"] == pytest.approx(np.mean([r["density"] for r in newest]))
        assert row["raw_bytes"] == sum(r["raw_bytes"] for r in newest) == 2 * 4 * row["numel"]
        assert row["encoded_bytes"] == sum(r["encoded_bytes"] for r in newest) > 0
        assert row["ratio"] == pytest.approx(row["raw_bytes"] / row["encoded_bytes"])
        # raw: fp32 (32) or a Tail small layer as float16 (16)
        assert row["bits"] in ({16.0, 32.0} if row["code"] in ("raw", "sparse-pos") else {4.0, 8.0})
        if row["code"] != "raw":
            assert row["ratio"] > 1.0
    assert 0 < served["fc1.weight"]["density"] < 0.05  # the sparse layer is sparse


def test_a_density_outside_0_1_from_an_old_worker_is_stored_as_unknown(storage_url: str) -> None:
    """Workers of an older release sent -134,217,727.6; storage keeps such a share as null
    (shown as unknown) instead of averaging it into the dashboard."""
    db = storage_url
    bad = LayerMetric(
        job_id="old", step=0, rank=0, layer="fc1.weight", numel=8192, bits=4, density=-134_217_727.6,
        raw_bytes=32768, encoded_bytes=900, ratio=32768 / 900, rel_error=0.03, code="sparse-rans",
    )  # fmt: skip
    with open_storage(db) as store:
        store.insert_job(job_id="old", name="old", source="api", status="RUNNING", entrypoint="x", spec=None)
        store.ingest("old", IngestBatch([{"seq": 1, **bad.to_dict()}], 1))
    with TestClient(create_app(make_settings(db, None))) as client:
        (row,) = client.get("/v1/jobs/old/metrics/layers", headers=AUTH).json()
    assert row["density"] is None and row["encoded_bytes"] == 900
