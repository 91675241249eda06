"""Smoke run of the convergence benchmark: a few steps, two methods, the JSON it writes."""

import json
import time

import pytest

from jobs import bench_convergence
from tail_ray.collective.transport import SIZE_BYTES
from tail_ray.compression.wire import PAYLOAD_OVERHEAD_BYTES


def test_bench_convergence_smoke_writes_a_row_per_method(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = [
        "--tasks",
        "digits",
        "--methods",
        "none,tail",
        "--steps",
        "6",
        "--seed",
        "3",
        "--timeout-s",
        "300",
    ]
    variant = ["--tail-variant", '{"allocation": "model"}']
    plot = tmp_path / "img" / "bits.png"
    bench_convergence.main([*args, *variant, "--json", str(out), "--plot", str(plot)])
    rows = json.loads(out.read_text())
    assert [r["label"] for r in rows] == ["none", "tail", "tail*1"]
    assert {r["seed"] for r in rows} == {3} and {r["clock"] for r in rows} == {"wall"}
    none, tail, model = rows
    assert 0.0 <= none["final"]["val_accuracy"] <= 1.0
    # Tail really compresses; none sends the fp32 gradients (ring model, 2 workers: their size).
    assert none["bytes_sent_per_step"] == none["raw_bytes_per_step"]
    assert 0 < tail["bytes_sent_per_step"] < none["bytes_sent_per_step"]
    assert tail["tail_bits"] is not None
    # Rank 0 sends its own payload at its exact size: its encoded layers plus, per exchange, a
    # size word, the payload header and checksum (DDP's one bucket here). Padded to the longer
    # rank's, as gloo's all-gather would, it would be hundreds of bytes more.
    overhead = tail["bytes_sent_per_step_2nd_half"] - tail["own_bytes_per_step_2nd_half"]
    assert overhead == SIZE_BYTES + PAYLOAD_OVERHEAD_BYTES, overhead
    # Every rank's own payload (rank order, rank 0 first).
    own = tail["own_bytes_by_rank"]
    assert len(own) == 2 and own[0] == tail["own_bytes_per_step_2nd_half"]
    assert all(b > 0 for b in own)
    # Both tail rows record every quantized layer's bits at every step.
    for row in (tail, model):
        history = row["tail_bits_history"]
        assert history and all(len(bits) == 6 for bits in history.values())
        assert row["tail_lowrank_history"].keys() == history.keys()
        assert all(len(ranks) == 6 for ranks in row["tail_lowrank_history"].values())
        assert any(b < 32 for bits in history.values() for b in bits)
        assert 0 < row["tail_decision_share"] < 1
        # The steady share leaves out the first steps (kernel loading): their cost is apart.
        assert 0 <= row["tail_decision_share_steady"] < 1
        assert row["tail_decision_first_s"] > 0 and row["tail_decisions"] >= 2  # both layers decided
    printed = capsys.readouterr().out
    assert "== digits (6 steps" in printed and "reduction" in printed
    assert "of compress time (after step 5:" in printed
    assert "[tail] own payload per rank, 2nd half:" in printed
    assert "[digits / tail*1] bits per layer over steps" in printed
    # --plot: the heat map of both tail rows, a real PNG (its folder made on the way).
    assert f"wrote {plot}" in printed
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and plot.stat().st_size > 10_000


def test_bits_over_steps_samples_evenly_and_drops_raw_layers():
    # conv.bias raw throughout, norm.weight a small layer as float16 throughout: both left out
    history = {
        "conv.weight": [8, 8, 4, 4, 4, 3, 3, 3, 4, 4],
        "conv.bias": [32] * 10,
        "norm.weight": [16] * 10,
    }
    shown, table = bench_convergence.bits_over_steps(history, columns=4)
    assert shown == [0, 3, 6, 9]
    assert table == {"conv.weight": [8, 4, 3, 4]}
    assert bench_convergence.bits_over_steps({}, columns=4) == ([], {})


def test_low_rank_steps_show_as_their_rank_not_as_the_factors_bits(tmp_path, capsys):
    """A low-rank step's LayerStats.bits are the factors' (8): the table prints rN there and
    the heat map gives it a colour of its own, and leaving low-rank counts as a change."""
    row = {
        "task": "digits",
        "label": "tail",
        "method": "tail",
        "tail_bits_history": {"fc1.weight": [4, 4, 8, 8, 8, 4], "fc2.weight": [4, 4, 4, 3, 3, 4]},
        "tail_lowrank_history": {"fc1.weight": [0, 0, 16, 16, 8, 0], "fc2.weight": [0] * 6},
    }
    bench_convergence.print_bits_over_steps([row], columns=6)
    printed = capsys.readouterr().out.splitlines()
    lines = {line.split()[0]: line.split()[1:] for line in printed if "weight" in line}
    assert lines["fc1.weight"] == ["4", "4", "r16", "r16", "r8", "4", "3"]
    assert lines["fc2.weight"] == ["4", "4", "4", "3", "3", "4", "2"]
    png = bench_convergence.write_bits_plot([row], tmp_path / "bits.png", {})
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")


def test_bench_convergence_runs_more_workers_through_the_sharded_collective(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--tasks", "digits", "--methods", "none,tail", "--steps", "4", "--timeout-s", "300"]
    bench_convergence.main([*args, "--world-size", "3", "--collective", "sharded", "--json", str(out)])
    none, tail = json.loads(out.read_text())
    assert none["world_size"] == tail["world_size"] == 3
    assert none["collective"] == "allreduce" and tail["collective"] == "sharded"
    # Ring model at 3 workers: 2 * 2/3 of the raw gradient; Tail far less.
    assert none["bytes_sent_per_step"] == pytest.approx(2 * 2 * none["raw_bytes_per_step"] / 3, rel=1e-3)
    assert 0 < tail["bytes_sent_per_step"] < none["bytes_sent_per_step"] / 4
    assert "3 workers, gloo, payload methods: sharded" in capsys.readouterr().out


def test_bench_convergence_runs_the_example_models_as_tasks(tmp_path):
    """gpt2 (Hugging Face transformers) and resnet18 come from examples/: users' own models."""
    out = tmp_path / "bench.json"
    args = ["--tasks", "gpt2,resnet18", "--methods", "none,tail", "--steps", "3", "--timeout-s", "500"]
    bench_convergence.main([*args, "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(r["task"], r["label"]) for r in rows] == [
        ("gpt2", "none"), ("gpt2", "tail"), ("resnet18", "none"), ("resnet18", "tail"),
    ]  # fmt: skip
    by = {(r["task"], r["label"]): r for r in rows}
    assert by["gpt2", "none"]["final"]["val_loss"] > 0
    assert 0.0 <= by["resnet18", "none"]["final"]["val_accuracy"] <= 1.0
    resnet_params = 11_181_642  # torchvision's resnet18(num_classes=10)
    assert by["resnet18", "none"]["raw_bytes_per_step"] == 4 * resnet_params
    for task in ("gpt2", "resnet18"):
        assert 0 < by[task, "tail"]["bytes_sent_per_step"] < by[task, "none"]["bytes_sent_per_step"]


def test_low_rank_trials_are_summarised_per_trial_not_only_as_a_share():
    # A fat tail (one slow trial) shows in the mean and max, not in the median.
    times_s = [(0.0005, 0.0004), (0.0006, 0.0005), (0.0300, 0.0050)]
    summary = bench_convergence._trial_times_ms(times_s)
    assert summary["n"] == 3
    assert summary["wall_median"] == pytest.approx(0.6)
    assert summary["wall_mean"] == pytest.approx(10.3667, abs=1e-3)
    assert summary["wall_max"] == pytest.approx(30.0)
    assert summary["cpu_mean"] == pytest.approx(1.9667, abs=1e-3)
    assert summary["cpu_max"] == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("variant", "message"),
    [('{"rounding": "round"}', "rounding must be one of"), ('{"roundng": "nearest"}', "unknown setting")],
)
def test_a_bad_tail_variant_is_refused_before_any_run(variant, message, capsys):
    with pytest.raises(SystemExit):
        bench_convergence.main(["--tasks", "digits", "--methods", "none", "--tail-variant", variant])
    assert message in capsys.readouterr().err


def test_the_cpu_clock_leaves_out_the_time_a_thread_is_not_running(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", time.perf_counter)  # put back after the test
    bench_convergence.use_clock("wall")
    start = time.perf_counter()
    time.sleep(0.2)
    assert time.perf_counter() - start >= 0.2
    bench_convergence.use_clock("cpu")
    start = time.perf_counter()
    time.sleep(0.2)  # asleep: no CPU time
    assert time.perf_counter() - start < 0.05
    spin_until = time.monotonic() + 0.1
    start = time.perf_counter()
    while time.monotonic() < spin_until:  # busy: CPU time advances
        pass
    assert time.perf_counter() - start > 0.02
    with pytest.raises(ValueError, match="clock must be one of"):
        bench_convergence.use_clock("gpu")
