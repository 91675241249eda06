"""The metrics path on a real Ray cluster: worker-side client (bounded, never blocks) and the
sink actor's cursor reads."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from tail_ray.metrics.client import MetricsClient
from tail_ray.metrics.sink import close_sink, find_sink, get_or_create_sink
from tests.ray_cluster import connected_cluster

pytestmark = pytest.mark.ray

SLOW_PUSH_S = 2.0


@pytest.fixture(scope="module", autouse=True)
def cluster():
    with connected_cluster(num_cpus=2, include_dashboard=False) as c:
        yield c


@pytest.fixture
def job_id():
    jid = f"test-{uuid.uuid4().hex[:8]}"
    yield jid
    close_sink(jid)


@ray.remote(num_cpus=0)
class SlowSink:
    """A sink that takes SLOW_PUSH_S per push: stands in for an overloaded or stuck sink. It has
    ``push`` only, as sinks of releases before ``push_rows`` had: the client falls back to it."""

    def __init__(self) -> None:
        self.received: list[dict] = []

    def push(self, records, dropped_by_worker=0, rank=-1):
        time.sleep(SLOW_PUSH_S)
        self.received.extend(records)
        return len(self.received)


def recs(n: int, start: int = 0) -> list[dict]:
    return [{"type": "step", "step": i} for i in range(start, start + n)]


def read_all(sink) -> list[dict]:
    return ray.get(sink.read.remote(0, 100_000))["records"]


def test_client_delivers_batches_in_order(job_id):
    sink = get_or_create_sink(job_id)
    client = MetricsClient(sink, rank=1, max_batch_records=7)
    client.extend(recs(25))
    assert client.queued_records == 25
    client.flush()
    assert client.queued_records == 0
    client.close(timeout_s=10)
    got = read_all(sink)
    assert [r["step"] for r in got] == list(range(25))
    assert [r["seq"] for r in got] == list(range(1, 26))
    assert client.dropped_records == 0
    assert ray.get(sink.stats.remote())["dropped_by_workers"] == 0


def test_client_pushes_columns_and_the_sink_gives_back_the_records(job_id):
    from tests.metrics.test_sink_rows import layer, step_rec

    sink = get_or_create_sink(job_id)
    client = MetricsClient(sink, rank=0, max_batch_records=100)
    assert client._columnar  # a sink of this release takes push_rows
    sent = [rec for step in range(3) for rec in (*(layer(step, 0, i) for i in range(4)), step_rec(step, 0))]
    sent = [{**r, "job_id": job_id} for r in sent]
    client.extend(sent)
    client.close(timeout_s=10)
    got = read_all(sink)
    # One push, numbered layers first, then the step records; every field as sent.
    assert [{k: v for k, v in r.items() if k != "seq"} for r in got] == [
        *(r for r in sent if r["type"] == "layer"),
        *(r for r in sent if r["type"] == "step"),
    ]
    page = ray.get(sink.read.remote(after_seq=0, limit=100, columnar=True))
    assert page["count"] == 15 and page["step"]["loss"] == [0.0, 1.0, 2.0]
    assert page["layer"]["seq"] == list(range(1, 13))


def test_full_queue_drops_oldest_counts_and_never_waits():
    slow = SlowSink.remote()
    ray.get(slow.__ray_ready__.remote())
    client = MetricsClient(slow, rank=0, queue_records=10, max_inflight_batches=1)
    assert not client._columnar  # no push_rows on this sink: records go by push
    client.extend(recs(3))
    client.flush()  # one push in flight; the sink holds it for SLOW_PUSH_S
    assert client.inflight_batches == 1
    client.extend(recs(30, start=100))
    t0 = time.monotonic()
    handed = client.flush()  # must not wait for the slow sink
    flush_s = time.monotonic() - t0
    assert handed == 0
    assert flush_s < SLOW_PUSH_S / 2, f"flush waited {flush_s:.2f} s on a slow sink"
    assert client.queued_records == 10
    assert client.dropped_records == 20
    # The newest records survive: the queue holds steps 120..129.
    client.close(timeout_s=3 * SLOW_PUSH_S)
    received = ray.get(slow.__ray_call__.remote(lambda self: [r["step"] for r in self.received]))
    assert received == [0, 1, 2, *range(120, 130)]
    ray.kill(slow)


def test_dead_sink_costs_records_not_errors(job_id):
    sink = get_or_create_sink(job_id)
    ray.get(sink.stats.remote())
    ray.kill(sink)
    # ray.kill is asynchronous: on a loaded machine a push sent right after it can still be
    # served. Wait until the actor is really gone, then the client must lose records, not raise.
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(sink.stats.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed sink kept answering for 60 s"
        time.sleep(0.2)
    client = MetricsClient(sink, rank=0)
    client.extend(recs(5))
    client.flush()  # must not raise
    client.close(timeout_s=10)
    assert client.dropped_records == 5
    assert client.failed_pushes >= 1


def test_no_sink_counts_everything_dropped():
    client = MetricsClient(None, rank=0)
    client.extend(recs(4))
    assert client.flush() == 0
    assert client.dropped_records == 4


def test_drop_counter_reaches_the_sink(job_id):
    sink = get_or_create_sink(job_id)
    for rank, dropped in ((0, 3), (1, 5)):
        client = MetricsClient(sink, rank=rank, queue_records=2)
        client.extend(recs(2 + dropped))
        client.close(timeout_s=10)
        assert client.dropped_records == dropped
    assert ray.get(sink.stats.remote())["dropped_by_workers"] == 8


def test_sink_cursor_pages_without_loss(job_id):
    sink = get_or_create_sink(job_id)
    ray.get(sink.push.remote(recs(5)))
    ray.get(sink.push.remote(recs(4, start=5)))
    first = ray.get(sink.read.remote(0, 3))
    assert [r["step"] for r in first["records"]] == [0, 1, 2]
    assert first["next_seq"] == 3 and first["last_seq"] == 9 and first["missed"] == 0
    rest = ray.get(sink.read.remote(first["next_seq"], 100))
    assert [r["step"] for r in rest["records"]] == list(range(3, 9))
    empty = ray.get(sink.read.remote(rest["next_seq"], 100))
    assert empty["records"] == [] and empty["next_seq"] == 9
    # A reader that restarts with an old cursor gets the same records again.
    again = ray.get(sink.read.remote(3, 100))
    assert [r["seq"] for r in again["records"]] == list(range(4, 10))


def test_sink_ring_buffer_reports_what_a_late_reader_missed(job_id):
    sink = get_or_create_sink(job_id, capacity_records=5)
    ray.get(sink.push.remote(recs(8)))
    page = ray.get(sink.read.remote(0, 100))
    assert [r["seq"] for r in page["records"]] == [4, 5, 6, 7, 8]
    assert page["missed"] == 3
    assert page["dropped_in_sink"] == 3
    # A reader already past the dropped part misses nothing.
    assert ray.get(sink.read.remote(5, 100))["missed"] == 0


def test_sink_is_found_by_job_id_and_closes(job_id):
    assert find_sink(job_id) is None
    sink = get_or_create_sink(job_id)
    ray.get(sink.push.remote(recs(2)))
    # get_or_create is idempotent: a restarted driver or worker gets the same actor and data.
    again = get_or_create_sink(job_id)
    assert ray.get(again.read.remote(0))["last_seq"] == 2
    assert not ray.get(sink.read.remote(0))["closed"]
    ray.get(sink.close.remote())
    assert ray.get(find_sink(job_id).read.remote(0))["closed"]
    close_sink(job_id)
    deadline = time.monotonic() + 10
    while find_sink(job_id) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert find_sink(job_id) is None
