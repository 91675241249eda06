"""jobs.report turns real benchmark JSON into PNG plots."""

import json
from pathlib import Path

from jobs import bench_convergence, report


def test_report_plots_a_real_convergence_run(tmp_path: Path) -> None:
    results, out = tmp_path / "runs", tmp_path / "img"
    results.mkdir()
    bench_convergence.main(
        [
            "--tasks",
            "digits",
            "--methods",
            "none,tail",
            "--steps",
            "6",
            "--timeout-s",
            "300",
            "--json",
            str(results / "bench_convergence.json"),
        ]
    )
    rows = json.loads((results / "bench_convergence.json").read_text())
    tail = next(r for r in rows if r["method"] == "tail")
    assert all(len(bits) == 6 for bits in tail["tail_bits_history"].values())
    assert report.main(["--results", str(results), "--out", str(out)]) == 0
    for name in ("traffic_vs_accuracy.png", "bits_per_layer.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_without_results_says_what_to_run(tmp_path: Path, caplog) -> None:
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "img")]) == 1
    assert "run jobs.bench_" in caplog.text
