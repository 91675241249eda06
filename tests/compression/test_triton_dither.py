"""Subtractive dither on the Triton backend against the numba kernels, bit for bit.

Dither's uniforms are keyed by position (the seed, the bucket, the chunk of 1,024 inside it,
a window of the shipped table), so the device draws the CPU's very uniforms: the levels, the
scales, the emptied residual, the controller's estimate, the sliced records of the sharded
exchanges and the receiver's rank mean must all be the numba path's bits. Without a GPU the
kernels run in Triton's interpreter (tests/compression/conftest.py); with one, compiled.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "run these tests through pytest (conftest.py)"

pytest.importorskip("triton", reason="the gpu extra (triton) is not installed")

from tail_ray.bitwidth.quant_error import bucket_errors  # noqa: E402
from tail_ray.compression import device_codec as dc  # noqa: E402
from tail_ray.compression.device import BACKEND_ENV, DeviceFlat  # noqa: E402
from tail_ray.compression.dither import mean_undithered_into  # noqa: E402
from tail_ray.compression.dither_slices import dither_in_slices, dither_on_device  # noqa: E402
from tail_ray.compression.grid import F32_MAX, levels_max, n_buckets  # noqa: E402
from tail_ray.compression.quantize import quantize_finite  # noqa: E402
from tail_ray.compression.records import Kind, QuantRecord  # noqa: E402
from tail_ray.compression.tail import TailCompressor, TailConfig  # noqa: E402
from tail_ray.compression.wire import decode_payload  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def _dev(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True)).to(DEV)


def _grad(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.uniform(0.01, 3.0)).astype(np.float32)


def _cpu_dither(g: np.ndarray, e: np.ndarray | None, bits: int, bucket: int, seed: int):  # type: ignore[no-untyped-def]
    levels = np.empty(g.size, np.int8)
    scales = np.empty(n_buckets(g.size, bucket), np.float32)
    e_after = None if e is None else e.copy()
    nnz, _ = quantize_finite(g, e_after, bits, bucket, seed, levels, scales, rounding="dither")
    return levels, scales, nnz, e_after


@pytest.mark.parametrize(
    ("bits", "bucket", "n", "with_e", "seed"),
    [
        (4, 512, 2000, False, 0xDEADBEEF),
        (3, 2048, 5000, True, 5),  # buckets of two chunks of uniforms, the last one partial
        (8, 100, 700, True, 0),
        (2, 64, 1000, False, 0xFFFFFFFF),
        (5, 8, 203, True, 1 << 40),  # only the seed's low 32 bits count (the payload's)
    ],
)
def test_dithered_levels_are_the_cpu_kernels_bit_for_bit(
    bits: int, bucket: int, n: int, with_e: bool, seed: int
) -> None:
    g = _grad(n, bits)
    g[:bucket] = 0.0  # bucket 0 all zero: scale 0, levels 0
    g[bucket : 2 * bucket] *= np.float32(2.0**-70)  # bucket 1 below TINY_SCALE: the prescale
    g[2 * bucket + 3] = np.float32(-1e-41)  # a negative denormal: floor(t + u) must stay exact
    e = (0.05 * _grad(n, 100 + bits)) if with_e else None
    levels, scales, nnz, e_after = _cpu_dither(g, e, bits, bucket, seed)
    res = _dev(e) if e is not None else None
    out = dc.quantize(DeviceFlat(_dev(g)), res, bits, bucket, seed, "dither")
    np.testing.assert_array_equal(out.levels, levels)
    np.testing.assert_array_equal(out.scales, scales)
    assert out.nnz == nnz and out.err_sq == 0.0
    if res is not None:  # a residual carried in is sent once, then empty on both backends
        assert e_after is not None and not e_after.any()
        assert not res.cpu().numpy().any()


def test_the_controller_estimate_under_dither_is_the_cpus() -> None:
    bucket, n = 128, 1100  # the last bucket partial (a lane tail)
    g = _grad(n, 11)
    g[256:384] = 0.0
    ids = np.array([8, 2, 5, 0, 3], dtype=np.int64)
    cands = (2, 3, 4, 5, 6, 8)
    got = dc.bucket_errors(DeviceFlat(_dev(g)), None, bucket, ids, cands, "dither")
    want = bucket_errors(g, None, bucket, ids, cands, "dither")
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1] and got[2] == want[2] == 4


def test_the_dithered_rank_mean_on_the_device_is_the_cpus() -> None:
    """Ranks of other bits, buckets (one over a chunk of uniforms) and seeds; an all-zero
    bucket; a scale at float32's max, whose top level decodes past it and saturates."""
    n = 2300
    specs = [(4, 128, 7), (2, 100, 0xFFFFFFFF), (8, 2048, 12345)]
    levels, scales = [], []
    rng = np.random.default_rng(6)
    for bits, bucket, _ in specs:
        lmax = levels_max(bits)
        levels.append(rng.integers(-lmax, lmax + 1, n).astype(np.int8))
        scales.append(np.abs(rng.standard_normal(n_buckets(n, bucket))).astype(np.float32))
    scales[0][1] = 0.0
    scales[1][2], levels[1][200:300] = F32_MAX, levels_max(2)
    bits_l, buckets, seeds = ([s[i] for s in specs] for i in range(3))
    want = np.empty(n, np.float32)
    mean_undithered_into(levels, scales, bits_l, buckets, seeds, want)
    out = torch.full((n,), 7.0, device=DEV)
    dc.mean_into(levels, scales, bits_l, buckets, out, dither_seeds=seeds)
    assert out.cpu().numpy().tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="2 dither seeds for 3 ranks"):
        dc.mean_into(levels, scales, bits_l, buckets, out, dither_seeds=seeds[:2])
    # A peer's non-finite scale (the wire does not look at floats): NaN stays NaN where the CPU
    # has it (the clamp to float32's max must not turn it into -max), and inf saturates.
    scales[0][3], scales[2][0] = np.float32(np.nan), np.float32(np.inf)
    mean_undithered_into(levels, scales, bits_l, buckets, seeds, want)
    dc.mean_into(levels, scales, bits_l, buckets, out, dither_seeds=seeds)
    got = out.cpu().numpy()
    assert np.isnan(want).any() and (np.isnan(got) == np.isnan(want)).all()
    finite = ~np.isnan(want)  # NaN payload bits may differ between devices
    assert got[finite].tobytes() == want[finite].tobytes()


@pytest.mark.parametrize("with_e", [False, True])
def test_sliced_records_are_the_hosts(with_e: bool) -> None:
    """The sharded exchanges' cuts: every slice from its own seed, the same record on both
    backends (slice seeds included)."""
    n, bucket, bits, seed = 3000, 256, 3, 77
    g = _grad(n, 4)
    e = 0.1 * _grad(n, 5) if with_e else None
    cuts = [0, 1024, 2048]
    levels, scales = np.empty(n, np.int8), np.empty(n_buckets(n, bucket), np.float32)
    host, host_nnz = dither_in_slices(
        g, None if e is None else e.copy(), bits, bucket, seed, cuts, levels, scales
    )
    dev, dev_nnz = dither_on_device(
        DeviceFlat(_dev(g)), None if e is None else _dev(e), bits, bucket, seed, cuts
    )
    assert dev.slice_seeds == host.slice_seeds and len(dev.slice_seeds or ()) == 3
    assert dev.dither_seed == host.dither_seed and dev_nnz == host_nnz
    np.testing.assert_array_equal(dev.levels, host.levels)
    np.testing.assert_array_equal(dev.scales, host.scales)
    with pytest.raises(ValueError, match="multiples of the bucket"):
        dither_on_device(DeviceFlat(_dev(g)), None, bits, bucket, seed, [0, 1000])


def test_tail_on_the_device_dithers_by_default_and_averages_as_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default on the Triton path is the CPU's: dither, one budget over the model, and
    the dithered rank mean written into the gradients is the CPU aggregate's, bit for bit."""

    def layers(seed: int) -> dict[str, torch.Tensor]:
        return {
            "w": _dev(_grad(5000, seed)),
            "b": _dev(_grad(40, seed + 1)),
            "v": _dev(0.01 * _grad(3000, seed + 2)),
        }

    monkeypatch.setenv(BACKEND_ENV, "triton")
    ranks = [TailCompressor(TailConfig(seed=r, lowrank="off")) for r in range(2)]
    payloads = [c.compress(layers(10 + r)) for r, c in enumerate(ranks)]
    assert (ranks[0].controller.rounding, ranks[0].controller.allocation) == ("dither", "model")
    kinds = {rec.kind for rec in decode_payload(payloads[0]) if isinstance(rec, QuantRecord)}
    assert kinds == {Kind.QUANT_DITHER}
    into = {k: torch.zeros_like(v) for k, v in layers(0).items()}
    ranks[0].aggregate(payloads, into, own=0)
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    want = {k: torch.zeros(v.shape) for k, v in layers(0).items()}
    TailCompressor(TailConfig(seed=0, lowrank="off")).aggregate(payloads, want)
    for name in want:
        assert into[name].cpu().numpy().tobytes() == want[name].numpy().tobytes(), name
