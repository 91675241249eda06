"""jobs.backend_traffic: refuses clearly without a GPU or the interpreter, and counts real traffic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from jobs.backend_traffic import capture, run


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the job would run")
def test_without_cuda_or_the_interpreter_it_says_so_and_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.backend_traffic", "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "TRITON_INTERPRET=1" in proc.stderr


def test_the_cpu_side_compresses_captured_digits_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured gradients are every worker's own (they differ), and Tail sends less than raw."""
    monkeypatch.setenv("TAIL_RAY_CODEC_BACKEND", "cpu")  # run() sets it; restored after the test
    captured = capture(steps=4, workers=2, batch=16, seed=0)
    assert len(captured) == 4 and len(captured[0]) == 2
    first = captured[0]
    assert first[0].keys() == first[1].keys()
    assert any(not torch.equal(first[0][n], first[1][n]) for n in first[0])
    got = run("cpu", captured, torch.device("cpu"))
    assert float(got["ratio"]) > 1.0 and float(got["second_half"]) > 1.0  # type: ignore[arg-type]
    assert got["lowrank_steps"] == {}  # 4 steps: no layer has had a low-rank trial yet
