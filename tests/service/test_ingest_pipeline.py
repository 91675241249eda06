"""The ingester's writer threads (service/ingest_pipeline.py) on both real backends: every
job's pages stored once and in order across writers, a failed write that never lets a later
page skip records, and a close that stores what was submitted."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from service_support import raw_rows, step_records

from service.ingest_pipeline import IngestPipeline
from service.storage import IngestBatch, Storage, open_storage, parse_storage_url

JOBS = ("j1", "j2", "j3", "j4", "j5")
PAGE_RECORDS = 7  # small pages: many per job, so an out-of-order store would skip some


@pytest.fixture
def store(storage_url: str) -> Iterator[Storage]:
    s = open_storage(storage_url)
    for job_id in JOBS:
        s.insert_job(job_id=job_id, name=job_id, source="api", status="RUNNING", entrypoint="x", spec=None)
    yield s
    s.close()


def _pages(job_id: str, steps: int, after_seq: int = 0) -> list[IngestBatch]:
    """A sink's pages of ``steps`` steps, seqs from 1, the ones after ``after_seq``."""
    sent = [r for step in range(steps) for r in step_records(job_id, step)]
    records = [{"seq": i + 1, **r} for i, r in enumerate(sent)]
    records = [r for r in records if r["seq"] > after_seq]
    return [
        IngestBatch(records[lo : lo + PAGE_RECORDS], records[lo : lo + PAGE_RECORDS][-1]["seq"])
        for lo in range(0, len(records), PAGE_RECORDS)
    ]


class _Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stored: dict[str, int] = {}

    def __call__(self, job_id: str, records: int) -> None:
        with self.lock:
            self.stored[job_id] = self.stored.get(job_id, 0) + records


@pytest.mark.parametrize("writers", [1, 2])
def test_every_jobs_pages_are_stored_once_and_in_order(store: Storage, writers: int) -> None:
    pages = {job_id: _pages(job_id, steps=6) for job_id in JOBS}
    counts = _Counts()
    pipeline = IngestPipeline(store, writers, on_stored=counts, max_pending_pages=3)
    try:
        for r in range(max(len(p) for p in pages.values())):  # as the drain reads: a round at a time
            for job_id, job_pages in pages.items():
                if r < len(job_pages):
                    pipeline.submit(job_id, job_pages[r])
        pipeline.wait()
    finally:
        pipeline.close()
    for job_id, job_pages in pages.items():
        last = job_pages[-1].next_seq
        # A page stored before an earlier one of its job would have moved the cursor past the
        # earlier page's records, which would then be dropped as already seen.
        assert store.seqs(job_id) == list(range(1, last + 1)), job_id
        assert store.cursor(job_id) == last and store.ingest_state(job_id)["records"] == last
        assert counts.stored[job_id] == last


_FAIL_AT = {  # the cursor write of the transaction that would move a job's cursor to 21 fails
    "sqlite": [
        "CREATE TRIGGER boom BEFORE UPDATE ON ingest_cursors WHEN NEW.after_seq = 21"
        " BEGIN SELECT RAISE(ABORT, 'disk full'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION boom() RETURNS trigger AS $$ BEGIN IF NEW.after_seq = 21 THEN"
        " RAISE EXCEPTION 'disk full'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER boom BEFORE UPDATE ON ingest_cursors FOR EACH ROW EXECUTE FUNCTION boom()",
    ],
}


def test_a_failed_write_stores_no_later_page_of_its_job(store: Storage, storage_url: str) -> None:
    backend = parse_storage_url(storage_url)[0]
    for sql in _FAIL_AT[backend]:
        raw_rows(storage_url, sql)
    pages = _pages("j1", steps=4)
    assert [p.next_seq for p in pages[:3]] == [7, 14, 21]
    pipeline = IngestPipeline(store, 1)
    try:
        for page in pages:
            pipeline.submit("j1", page)
        with pytest.raises(Exception, match="disk full"):
            pipeline.wait()
        # Pages 1-2 stored; page 3 failed; every later page was dropped, not stored past the gap.
        assert store.cursor("j1") == 14 and store.seqs("j1") == list(range(1, 15))
        pipeline.wait()  # the failure was raised once; the pipeline works again
        raw_rows(storage_url, "DROP TRIGGER boom" + (" ON ingest_cursors" if backend == "postgresql" else ""))
        for page in _pages("j1", steps=4, after_seq=store.cursor("j1")):  # the next pass, from the cursor
            pipeline.submit("j1", page)
        pipeline.wait()
    finally:
        pipeline.close()
    last = pages[-1].next_seq
    assert store.seqs("j1") == list(range(1, last + 1)) and store.ingest_state("j1")["records"] == last


def test_close_stores_what_was_submitted_then_refuses_more(store: Storage) -> None:
    pages = _pages("j1", steps=3)
    pipeline = IngestPipeline(store, 2)
    for page in pages:
        pipeline.submit("j1", page)
    pipeline.close()
    assert store.cursor("j1") == pages[-1].next_seq
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.submit("j1", pages[0])
    pipeline.close()  # twice is harmless


def test_writers_must_be_at_least_one(store: Storage) -> None:
    with pytest.raises(ValueError, match="writers must be >= 1, got 0"):
        IngestPipeline(store, 0)


def test_a_failing_stored_callback_neither_stops_the_writer_nor_loses_pages(store: Storage) -> None:
    def broken(job_id: str, records: int) -> None:
        raise RuntimeError("counter broke")

    pages = _pages("j1", steps=3)
    pipeline = IngestPipeline(store, 1, on_stored=broken)
    waiter = threading.Thread(target=pipeline.wait, daemon=True)
    try:
        for page in pages:
            pipeline.submit("j1", page)
        # wait() returns only if the writer thread lived on to finish the queue (bounded here:
        # a dead writer would leave it waiting for ever).
        waiter.start()
        waiter.join(timeout=60)
        assert not waiter.is_alive(), "the writer thread died with the callback"
    finally:
        if not waiter.is_alive():
            pipeline.close()
    assert store.cursor("j1") == pages[-1].next_seq
