"""Smoke test of `python -m jobs.load_test`: a few seconds of pollers and SSE streams against
the real service (uvicorn subprocess) while a backlog and live steps of several jobs are
stored. Asserts no errors and that every figure came out; never asserts speed (figures are
printed by the script, see docs/operations.md)."""

from __future__ import annotations

import os

from tests.jobs.job_run import run_job


def test_load_test_runs_clean_and_reports_figures() -> None:
    _stdout, out = run_job(
        "jobs.load_test", "--source", "direct", "--jobs", "2", "--ranks", "3",
        "--layers", "8", "--backlog-steps", "20", "--step-interval-s", "0.5", "--pollers", "6",
        "--streams", "2", "--duration-s", "4", "--poll-interval-s", "0.2", "--drain-timeout-s", "20",
        timeout_s=240,
    )  # fmt: skip
    assert out["errors"] == 0, out["first_errors"]
    assert out["client"] == "lean" and out["client_cpu_cores"] > 0
    # The machine is at least as busy as the parts of it counted (the ingest process is the
    # service's child: counted apart from it).
    assert out["ingest_cpu_cores"] >= 0
    assert out["machine_busy_cores"] >= out["service_cpu_cores"] + out["ingest_cpu_cores"] - 0.05
    assert set(out["routes"]) == {"layers", "steps", "summary"}
    for route in out["routes"].values():
        assert route["requests"] > 0 and route["p99_ms"] >= route["p50_ms"] > 0
    per_step = 3 * (8 + 1)
    assert out["backlog_records"] == 2 * 20 * per_step
    assert out["records_stored"] >= out["backlog_records"] and out["records_stored"] % per_step == 0
    assert out["ingest_records_per_s"] > 0 and out["caught_up_s"] > 0
    assert out["lag_steps"] > 0 and out["lag_p99_s"] >= out["lag_p50_s"] >= 0
    assert out["stream_events"] > 0 and out["stream_delay_p50_ms"] is not None


def test_load_test_through_real_sinks_stores_every_record() -> None:
    """The path the cluster-scale figures come from: a private Ray head, one sink actor per job
    filled by the producer with columnar pushes (as workers' MetricsClient pushes), the ingest
    process reading them."""
    _stdout, out = run_job(
        "jobs.load_test", "--jobs", "2", "--ranks", "3", "--layers", "6",
        "--backlog-steps", "5", "--step-interval-s", "0.5", "--pollers", "3", "--duration-s", "4",
        "--drain-timeout-s", "60", timeout_s=400, env={**os.environ, "RAY_AUTH_MODE": "token"},
    )  # fmt: skip
    assert out["source"] == "sink" and out["push"] == "rows" and out["errors"] == 0
    per_step = 3 * (6 + 1)
    assert out["backlog_records"] == 2 * 5 * per_step
    assert out["records_stored"] >= out["backlog_records"] and out["records_stored"] % per_step == 0
    assert out["lag_steps"] > 0 and out["ingest_records_per_s"] > 0
