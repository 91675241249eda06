"""Benchmark of a metrics sink's own cost per record, records pushed as dicts against as columns.

    python -m jobs.bench_sink [--ranks 32] [--layers 200] [--steps 10] [--page-records 5000]
                              [--repeat 3]

One job's steps (``jobs.load_test``'s records: ``ranks`` workers, ``layers`` layers) go through
the parts of the metrics path that do not need a network, in this process, each timed in
thread CPU seconds (wall time on a shared machine measures the neighbours):

- worker: a ``MetricsClient``'s batch made ready to send: ``rows_of`` (columns only) and
  pickling, as Ray pickles an actor call's arguments;
- sink, push: unpickling the batch and ``push`` / ``push_rows`` into the ring;
- sink, read: ``read(columnar=True)`` pages of ``page-records`` from the start, and pickling
  each page, as Ray pickles a reply;
- reader: unpickling the pages (the ingest process).

``records`` (``push``, the dicts every release before ``push_rows`` sent) and ``rows``
(``push_rows``) run alternately ``repeat`` times on one fresh sink each, so their ratio is
measured side by side. The sink is the actor's own class, called in this process: Ray's
scheduling and transport costs are not in the figures (they are the same for both forms, one
call per batch). Prints a table and, as the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
from typing import Any

from jobs.load_clients import Shape, rank_templates, step_batch
from tail_ray.metrics.columns import rows_of
from tail_ray.metrics.sink import MetricsSink

FORMS = ("records", "rows")
PARTS = ("worker", "sink_push", "sink_read", "reader")


def _cpu() -> float:
    return time.thread_time()


def run_once(form: str, batches: list[list[dict[str, Any]]], page_records: int) -> dict[str, float]:
    """CPU seconds of each part for one pass of every batch through a fresh sink."""
    sink = MetricsSink.__ray_actor_class__("bench-sink", capacity_records=10_000_000)  # type: ignore[attr-defined]
    cpu = dict.fromkeys(PARTS, 0.0)
    for batch in batches:
        t0 = _cpu()
        payload = pickle.dumps(rows_of(batch) if form == "rows" else batch, protocol=5)
        t1 = _cpu()
        if form == "rows":
            sink.push_rows(rows=pickle.loads(payload), rank=0)
        else:
            sink.push(records=pickle.loads(payload), rank=0)
        t2 = _cpu()
        cpu["worker"] += t1 - t0
        cpu["sink_push"] += t2 - t1
    after, stored = 0, 0
    while True:
        t0 = _cpu()
        reply = pickle.dumps(sink.read(after_seq=after, limit=page_records, columnar=True), protocol=5)
        t1 = _cpu()
        page = pickle.loads(reply)
        t2 = _cpu()
        cpu["sink_read"] += t1 - t0
        cpu["reader"] += t2 - t1
        if not page["count"]:
            break
        stored += page["count"]
        after = page["next_seq"]
    expected = sum(len(b) for b in batches)
    if stored != expected:
        raise RuntimeError(f"{form}: read back {stored} records of {expected} pushed")
    return cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=32, help="workers of the job")
    parser.add_argument("--layers", type=int, default=200, help="layers per model")
    parser.add_argument("--steps", type=int, default=10, help="steps pushed (one batch per rank and step)")
    parser.add_argument("--page-records", type=int, default=5_000, help="records per sink read")
    parser.add_argument("--repeat", type=int, default=3, help="passes of each form, alternating")
    args = parser.parse_args(argv)
    if min(args.ranks, args.layers, args.steps, args.page_records, args.repeat) < 1:
        parser.error("--ranks, --layers, --steps, --page-records and --repeat must be positive")
    shape = Shape(1, args.ranks, args.layers, 0.0)
    templates = rank_templates(shape, shape.job_id(0))
    batches = [step_batch(t, step, 1.0e9 + step) for step in range(args.steps) for t in templates]
    n = sum(len(b) for b in batches)
    runs: dict[str, list[dict[str, float]]] = {form: [] for form in FORMS}
    for _ in range(args.repeat):
        for form in FORMS:
            runs[form].append(run_once(form, batches, args.page_records))
    # Median over the passes of each part, in microseconds of CPU per record.
    us = {f: {p: statistics.median(r[p] for r in runs[f]) * 1e6 / n for p in PARTS} for f in FORMS}
    for f in FORMS:
        us[f]["sink"] = us[f]["sink_push"] + us[f]["sink_read"]
    shape_text = f"{args.steps} steps x {args.ranks} ranks x {args.layers + 1}"
    print(f"{n:,} records ({shape_text}), CPU per record, median of {args.repeat} passes")
    print(f"{'CPU us/record':<14}" + "".join(f"{p:>11}" for p in (*PARTS, "sink")))
    for f in FORMS:
        print(f"{f:<14}" + "".join(f"{us[f][p]:>11.2f}" for p in (*PARTS, "sink")))
    ratio = {p: us["records"][p] / us["rows"][p] if us["rows"][p] else None for p in (*PARTS, "sink")}
    print(f"{'records/rows':<14}" + "".join(f"{r:>10.2f}x" if r else f"{'-':>11}" for r in ratio.values()))
    out = {"records": n, "repeat": args.repeat, "cpu_us_per_record": us, "records_over_rows": ratio}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
