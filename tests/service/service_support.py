"""Helpers shared by the service tests: a Ray head per module, settings, records, a live server."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from service.ray_head import HeadPorts, LocalRayHead, free_port, short_temp_dir
from service.serve import uvicorn_config
from service.settings import Settings
from service.storage import IngestBatch, Storage, parse_storage_url
from tail_ray.metrics.records import LayerMetric, StepMetric

API_TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
LAYERS = ("conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight")


@contextmanager
def ray_cluster(tmp_dir: Path, num_cpus: int = 2) -> Iterator[LocalRayHead]:
    """A private Ray head on free ports, this process connected as a driver. Its own Ray temp
    dir: a job driver joins the cluster named there, never one someone else started later."""
    import ray

    temp = short_temp_dir()
    head = LocalRayHead(
        HeadPorts.pick(), num_cpus=num_cpus, log_path=tmp_dir / "ray-head.log", temp_dir=temp, stop_grace_s=10
    )
    head.start()
    try:
        ray.init(address=head.ports.gcs_address, log_to_driver=False, configure_logging=False)
        yield head
    finally:
        ray.shutdown()
        head.stop()
        shutil.rmtree(temp, ignore_errors=True)


def make_settings(db: Path | str, head: LocalRayHead | None, **overrides: Any) -> Settings:
    """Test settings; ``db`` is a SQLite path or a database URL (either backend)."""
    values: dict[str, Any] = {
        "api_token": API_TOKEN,
        "database_url": db if isinstance(db, str) else f"sqlite://{db}",
        "ingest_interval_s": 0.2,
        "sync_interval_s": 0.5,
        "drain_grace_s": 0.5,
        "sse_interval_s": 0.2,
        "read_max_staleness_s": 0.0,  # tests read right after they ingest; one test sets its own
        # Starlette's TestClient sends "Host: testserver".
        "allowed_hosts": ["127.0.0.1", "localhost", "::1", "testserver"],
        # Many tests insert a RUNNING job as a stand-in that Ray never had; the reconciler
        # would (rightly) mark it lost. Tests of reconciliation set their own value.
        "lost_after_s": 3600.0,
    }
    if head is not None:
        values["ray_address"] = head.ports.gcs_address
        values["ray_dashboard_url"] = head.ports.dashboard_url
    else:
        values["ray_dashboard_url"] = f"http://127.0.0.1:{free_port()}"
        values["ingest_enabled"] = False
    values.update(overrides)
    return Settings(**values)


def step_records(
    job_id: str, step: int, ranks: int = 2, ratio_scale: float = 1.0, layers: tuple[str, ...] = LAYERS
) -> list[dict[str, Any]]:
    """The records `ranks` workers would send for one step (layer records, then a step record)."""
    out: list[dict[str, Any]] = []
    for rank in range(ranks):
        raw_total = sent_total = 0
        for i, layer in enumerate(layers):
            numel = 1000 * (i + 1)
            raw = 4 * numel
            bits = 2 + (i + step) % 6
            encoded = max(1, int(raw / (ratio_scale * (i + 2))))
            raw_total += raw
            sent_total += encoded
            out.append(
                LayerMetric(
                    job_id=job_id, step=step, rank=rank, layer=layer, numel=numel, bits=bits,
                    density=0.5, raw_bytes=raw, encoded_bytes=encoded, ratio=raw / encoded,
                    rel_error=0.01 * bits, code="tail",
                ).to_dict()
            )  # fmt: skip
        out.append(
            StepMetric(
                job_id=job_id, step=step, rank=rank, world_size=ranks, bytes_sent=sent_total,
                bytes_received=sent_total * (ranks - 1), raw_bytes=raw_total, compress_s=0.001,
                decode_s=0.001, comm_s=0.002, step_s=0.01 + 0.001 * rank, loss=2.0 / (step + 1) + 0.1 * rank,
                method="tail", wall_time_s=time.time(),
            ).to_dict()
        )  # fmt: skip
    return out


def raw_rows(url: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run SQL (``?`` placeholders) on a fresh connection of the backend a URL names, outside
    the storage code under test, and commit: for recomputations and sabotage in tests."""
    backend, target = parse_storage_url(url)
    if backend == "sqlite":
        with contextlib.closing(sqlite3.connect(target, isolation_level=None)) as conn:
            return [tuple(r) for r in conn.execute(sql, params).fetchall()]
    import psycopg

    with psycopg.connect(target, autocommit=True) as conn:
        cur = conn.execute(sql.replace("?", "%s").encode() if params else sql.encode(), params or None)
        return [tuple(r) for r in cur.fetchall()] if cur.description else []


def seed_finished_job(storage: Storage, job_id: str, steps: int) -> None:
    """A SUCCEEDED job whose sink is drained, with ``steps`` steps of 2-rank metrics, written
    through ``Storage`` (what the ingester does), so the read routes and the SSE stream run to
    their end without Ray."""
    storage.insert_job(
        job_id=job_id, name="done", source="api", status="SUCCEEDED", entrypoint="x", spec=None
    )
    records = [r for step in range(steps) for r in step_records(job_id, step)]
    for seq, rec in enumerate(records, start=1):
        rec["seq"] = seq
    storage.ingest(job_id, IngestBatch(records=records, next_seq=len(records)))
    storage.mark_drained(job_id)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip


@contextmanager
def chromium_page() -> Iterator[Any]:
    """A page in Debian's headless Chromium driven by Playwright (never `playwright install`)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": 1400, "height": 1000})
        finally:
            browser.close()


class LiveServer:
    """The real app under uvicorn in a thread, on a free loopback port, configured as
    `tail-ray up` runs it (service/serve.py: request-head timeout and all)."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(settings, host="127.0.0.1", port=self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 30, "uvicorn to start", 0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
