"""Smoke run of the convergence benchmark: a few steps, two methods, the JSON it writes."""

import json

from jobs import bench_convergence


def test_bench_convergence_smoke_writes_a_row_per_method(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--tasks", "digits", "--methods", "none,tail", "--steps", "6", "--timeout-s", "300"]
    bench_convergence.main([*args, "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["label"] for r in rows] == ["none", "tail"]
    none, tail = rows
    assert 0.0 <= none["final"]["val_accuracy"] <= 1.0
    # Tail really compresses; none sends the fp32 gradients (ring model, 2 workers: their size).
    assert none["bytes_sent_per_step"] == none["raw_bytes_per_step"]
    assert 0 < tail["bytes_sent_per_step"] < none["bytes_sent_per_step"]
    assert tail["tail_bits"] is not None
    printed = capsys.readouterr().out
    assert "== digits (6 steps" in printed and "reduction" in printed
