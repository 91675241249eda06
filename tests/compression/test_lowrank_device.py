"""Low-rank layers of device gradients (lowrank_device.py) against the host path.

The reconstruction every receiver adds to its mean must be the numba kernel's bits, and so must
the mean a CUDA receiver writes; the sender's residual must be its M less exactly that. The
factors themselves come from the device's products, so they may differ from the host's in the
last bits. Without a GPU the kernels run in Triton's interpreter (conftest.py); with one,
compiled.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "run these tests through pytest (conftest.py)"

pytest.importorskip("triton", reason="the gpu extra (triton) is not installed")

from tail_ray.compression import lowrank_device as ld  # noqa: E402
from tail_ray.compression.device import BACKEND_ENV  # noqa: E402
from tail_ray.compression.lowrank import reconstruct  # noqa: E402
from tail_ray.compression.lowrank_kernels import power_step_arrays  # noqa: E402
from tail_ray.compression.rank_mean import mean_into  # noqa: E402
from tail_ray.compression.records import LowRankRecord  # noqa: E402
from tail_ray.compression.tail import TailCompressor, TailConfig  # noqa: E402
from tail_ray.compression.wire import decode_payload  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def _factors_record(
    rows: int, cols: int, rank: int, bits: int, seed: int, scale: float | None = None
) -> LowRankRecord:
    rng = np.random.default_rng(seed)
    q_scale = rng.uniform(1e-3, 1e3) if scale is None else scale
    p = torch.from_numpy((rng.standard_normal((rows, rank)) * (scale or 1.0)).astype(np.float32))
    q = torch.from_numpy((rng.standard_normal((cols, rank)) * q_scale).astype(np.float32))
    from tail_ray.compression.lowrank import quantize_factors

    return quantize_factors("w", p, q, rows, cols, bits=bits, bucket_size=64, seed=seed)


@pytest.mark.parametrize(
    ("rows", "cols", "rank", "bits"),
    [(96, 160, 4, 8), (33, 70, 1, 2), (200, 65, 16, 4), (1, 300, 1, 3), (257, 129, 3, 6)],
)
def test_device_reconstruction_is_the_host_kernels_bits(rows: int, cols: int, rank: int, bits: int) -> None:
    """Tiles that end mid-row and mid-column, ranks 1-16, factors of very different scales."""
    rec = _factors_record(rows, cols, rank, bits, seed=rows + cols)
    got = ld.reconstruct_on(rec, DEV).cpu().numpy()
    assert got.tobytes() == reconstruct(rec).tobytes()


@pytest.mark.parametrize("scale", [1e-20, 1e-22, 3e-23])
def test_device_reconstruction_keeps_denormal_products(scale: float) -> None:
    """Factors of ~1e-20 give products of ~1e-40, below float32's normal range: a compiled kernel
    that flushed denormals (in the widening or the final rounding) would differ from the CPU."""
    rec = _factors_record(70, 90, 4, 8, seed=5, scale=scale)
    want = reconstruct(rec)
    assert np.any((want != 0) & (np.abs(want) < np.finfo(np.float32).tiny))  # denormals made
    assert ld.reconstruct_on(rec, DEV).cpu().numpy().tobytes() == want.tobytes()


def test_device_mean_is_the_grids_rank_mean_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    for world in (1, 2, 3, 5):
        vals = [
            (rng.standard_normal(3001) * 10.0 ** rng.integers(-30, 30)).astype(np.float32)
            for _ in range(world)
        ]
        want = np.empty(3001, np.float32)
        mean_into(vals, want)
        out = torch.empty(3001, dtype=torch.float32, device=DEV)
        ld.mean_tensors_on_device([torch.from_numpy(v).to(DEV) for v in vals], out)
        assert out.cpu().numpy().tobytes() == want.tobytes(), world


def test_device_power_step_matches_the_host_one_closely() -> None:
    """The device's products run in its own order: the same subspace to rounding, not the bits."""
    rng = np.random.default_rng(4)
    m = (rng.standard_normal((120, 8)) @ rng.standard_normal((8, 90))).astype(np.float32)
    q = rng.standard_normal((90, 4)).astype(np.float32)
    p_host, q_host = power_step_arrays(m, q)
    p_dev, q_dev = ld.power_step_device(torch.from_numpy(m).to(DEV), torch.from_numpy(q))
    assert p_dev.device.type == "cpu" and q_dev.device.type == "cpu"
    np.testing.assert_allclose(p_dev.numpy(), p_host, atol=1e-5)
    np.testing.assert_allclose(q_dev.numpy(), q_host, rtol=1e-4, atol=1e-3)
    # P orthonormal; a zero M gives zero factors (nothing sent), as on the host.
    np.testing.assert_allclose(p_dev.numpy().T @ p_dev.numpy(), np.eye(4), atol=1e-5)
    p0, q0 = ld.power_step_device(torch.zeros(120, 90, device=DEV), torch.from_numpy(q))
    assert not p0.any() and not q0.any()


def _low_rank_gradient(rows: int, cols: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    u, v = torch.randn(rows, 2, generator=gen), torch.randn(cols, 2, generator=gen)
    step_gen = torch.Generator().manual_seed(step)
    coeff = 1.0 + 0.1 * torch.randn(2, generator=step_gen)
    return (u * coeff) @ v.T + 0.05 * torch.randn(rows, cols, generator=step_gen)


def _residual(comp: TailCompressor, numel: int) -> torch.Tensor:
    """The residual carried into the next compress (host copy; zeros where there is none)."""
    assert comp.feedback is not None
    return comp.feedback.state_dict().get("w", torch.zeros(numel))


def test_a_device_layer_goes_lowrank_with_exact_error_feedback_and_averages_as_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A low-rank-friendly matrix on the device: the chooser's trial runs there and the layer
    goes low-rank; each step the device residual is M less exactly what receivers reconstruct,
    and the mean written into a device gradient is the CPU aggregate's bits."""
    monkeypatch.setenv(BACKEND_ENV, "triton")
    config = TailConfig(lowrank="on", warmup_steps=0, redecide_every_steps=4, seed=7)
    ranks = [TailCompressor(config) for _ in range(2)]
    seen = 0
    for step in range(8):
        grads = [_low_rank_gradient(96, 160, 2 * step + r).to(DEV) for r in range(2)]
        e_before = [_residual(c, 96 * 160) for c in ranks]
        payloads = [c.compress({"w": g}) for c, g in zip(ranks, grads, strict=True)]
        recs = [decode_payload(p)[0] for p in payloads]
        if not all(isinstance(rec, LowRankRecord) for rec in recs):
            continue
        seen += 1
        for r, rec in enumerate(recs):
            assert isinstance(rec, LowRankRecord)
            m = (grads[r].reshape(-1).cpu() + e_before[r]).numpy()
            e_after = _residual(ranks[r], m.size).numpy()
            assert e_after.tobytes() == (m - reconstruct(rec)).tobytes()
        into = {"w": torch.zeros(96, 160, device=DEV)}
        ranks[0].aggregate(payloads, into, own=0)
        monkeypatch.setenv(BACKEND_ENV, "cpu")
        want = {"w": torch.zeros(96, 160)}
        TailCompressor(TailConfig(seed=0)).aggregate(payloads, want)
        monkeypatch.setenv(BACKEND_ENV, "triton")
        assert into["w"].cpu().numpy().tobytes() == want["w"].numpy().tobytes()
    assert seen >= 4
    assert ranks[0].last_stats[0].code.startswith("lowrank")


def test_a_layer_some_ranks_sent_lowrank_and_one_raw_averages_on_the_device_as_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank whose layer was not finite sends it raw while the others send factors: the device
    mean of that mix (each rank's layer made on the device or copied up) is the CPU's bits."""
    from tail_ray.compression.aggregate import mean_records_into
    from tail_ray.compression.records import QuantRecord, RawRecord

    low = _factors_record(96, 160, 4, 8, seed=1)
    rng = np.random.default_rng(2)
    raw = RawRecord("w", rng.standard_normal(96 * 160).astype(np.float32))
    levels = rng.integers(-7, 8, 96 * 160).astype(np.int8)
    quant = QuantRecord("w", 4, 512, rng.uniform(0.1, 2.0, 30).astype(np.float32), levels)
    by_rank = [{"w": low}, {"w": raw}, {"w": _factors_record(96, 160, 2, 4, seed=3)}, {"w": quant}]
    monkeypatch.setenv(BACKEND_ENV, "triton")
    into = {"w": torch.zeros(96, 160, device=DEV)}
    mean_records_into(by_rank, into)
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    want = {"w": torch.zeros(96, 160)}
    mean_records_into(by_rank, want)
    assert into["w"].cpu().numpy().tobytes() == want["w"].numpy().tobytes()
