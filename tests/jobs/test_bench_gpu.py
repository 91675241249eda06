"""jobs.bench_gpu: refuses clearly without CUDA, and its plain-torch baseline is a real quantizer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from jobs.bench_gpu import Shape, torch_dequantize4, torch_quantize4


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "jobs.bench_gpu", "--quick"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--interpret" in proc.stderr and "gpu_check.sh" in proc.stderr


def test_plain_torch_baseline_quantizes_within_one_step() -> None:
    """The row the Triton path is compared against must be a correct 4-bit quantizer (else its
    GB/s would flatter it): levels in [-7, 7], values within one step of the input."""
    x = torch.randn(5000) * 0.01
    packed, scales = torch_quantize4(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 5120 // 2
    y = torch_dequantize4(packed, scales, x.numel())
    step = (scales / 7.0).repeat_interleave(512)[: x.numel()]
    assert ((y - x).abs() <= step * (1 + 1e-5)).all()


def test_gradient_set_is_the_issues_151m_transformer() -> None:
    numel = sum(int(torch.Size(s).numel()) for _, s in Shape(1024, 12).layers())
    assert 150e6 < numel < 152e6
