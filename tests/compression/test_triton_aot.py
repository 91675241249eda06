"""Every device-codec kernel builds for an H100/H200 (sm_90) through Triton's real compiler,
on this CPU-only machine, and its PTX has no fused multiply-add, no approximate division and
no flush of denormals to zero.

The interpreter tests (test_triton_codec.py) check what the kernels compute; they cannot see
what the compiler makes of them (types, constexpr rules, FMA contraction). A subprocess,
because those tests set TRITON_INTERPRET=1 for the whole pytest process. No ``.ftz`` either:
a denormal flushed to zero would round differently from the CPU grid.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

# find_spec, not importorskip: importing triton here, before TRITON_INTERPRET is set, would make
# triton.language's own helpers compiled-only for the interpreter tests of this session.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the gpu extra (triton) is not installed"
)


def test_kernels_compile_for_sm90_without_fma() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tail_ray.compression.triton_aot", "--arch", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if "cubin" in line]
    names = {r[0] for r in rows}
    for tag in ("dither", "nearest", "stochastic"):  # each rounding is its own compiled kernel
        assert {f"quantize_ef_pack4_{tag}", f"quantize_int8_{tag}", f"bucket_errors_{tag}"} <= names
    assert {"quantize_pack4_dither_2k", "pack4", "dequantize3", "mean", "mean_dither"} <= names
    assert "lowrank_reconstruct" in names  # lowrank_device.py
    for r in rows:  # name cubin N B fma N approx div N ftz N
        assert int(r[2]) > 0 and r[5] == "0" and r[8] == "0" and r[10] == "0", r
