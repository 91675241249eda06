"""How much a busy ingest thread delays the service's requests through the interpreter lock, at
two GIL switch intervals (CPython's default 5 ms, and the 1 ms the service sets).

    python -m jobs.bench_switch_interval [--rounds 3] [--requests 200]

A "request" is what a read route does between threads: three round trips from the event loop
to a worker thread that reads storage (dependency, version, data). The "ingest thread" converts
a 32-rank x 200-layer step of records in a loop (pure Python, as ``Storage.ingest`` does before
its transaction). Every setting is measured in each round, in turn, so machine noise hits all of
them; prints the medians over rounds of each trial's p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time

from jobs.load_clients import Shape, rank_templates, step_batch
from service.storage import Storage, open_storage
from service.storage.records import batch_rows


def _records() -> list[dict]:
    shape = Shape(1, 32, 200, 1.0)
    templates = rank_templates(shape, "bench")
    return [{"seq": i + 1, **r} for i, r in enumerate(r for t in templates for r in step_batch(t, 0, 0.0))]


def _convert_until(stop: threading.Event, records: list[dict]) -> None:
    while not stop.is_set():
        batch_rows("bench", records, 0)


async def _trial(storage: Storage, n_requests: int) -> tuple[float, float]:
    latencies = []
    for _ in range(n_requests):
        t0 = time.perf_counter()
        for _ in range(3):
            await asyncio.to_thread(storage.get_job, "bench")
        latencies.append(time.perf_counter() - t0)
        await asyncio.sleep(0.002)
    latencies.sort()
    return latencies[len(latencies) // 2], latencies[int(0.99 * (len(latencies) - 1))]


async def run(rounds: int, n_requests: int) -> dict[tuple[float, bool], list[tuple[float, float]]]:
    records = _records()
    with tempfile.TemporaryDirectory() as tmp, open_storage(f"sqlite://{tmp}/bench.sqlite") as storage:
        storage.insert_job(
            job_id="bench", name="bench", source="api", status="RUNNING", entrypoint="-", spec=None
        )
        results: dict[tuple[float, bool], list[tuple[float, float]]] = {}
        for _ in range(rounds):
            for interval_s in (0.005, 0.001):
                sys.setswitchinterval(interval_s)
                for busy in (False, True):
                    stop = threading.Event()
                    worker = threading.Thread(target=_convert_until, args=(stop, records))
                    if busy:
                        worker.start()
                    results.setdefault((interval_s, busy), []).append(await _trial(storage, n_requests))
                    stop.set()
                    if busy:
                        worker.join()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="per trial")
    args = parser.parse_args(argv)
    default = sys.getswitchinterval()
    try:
        results = asyncio.run(run(args.rounds, args.requests))
    finally:
        sys.setswitchinterval(default)
    print(f"{'switch interval':<16} {'ingest thread':<14} {'p50 ms':>8} {'p99 ms':>8}")
    for (interval_s, busy), trials in results.items():
        p50 = statistics.median(t[0] for t in trials) * 1000
        p99 = statistics.median(t[1] for t in trials) * 1000
        print(f"{interval_s * 1000:>6.0f} ms{'':<7} {'busy' if busy else 'idle':<14} {p50:>8.2f} {p99:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
