"""The Triton device codec against the CPU path (numba kernels, numpy references).

Without a GPU (CI) every kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below
before triton is imported) on CPU tensors; with one, the same tests run compiled on CUDA.
Interpreted kernels are slow, so tensors stay at a few thousand elements.

Exact (same bits): scales, residual, the controller's sampled statistics, packing, unpacking,
dequantization, the rank mean, the payload given the same levels, and the levels themselves
against the numpy reference of the device quantizer (same counter-based random stream). Under
subtractive dither (Tail's default) and round-to-nearest the levels, residuals and so whole
Tail payloads are the numba path's, bit for bit (dither's kernels: test_triton_dither.py).
Stochastic levels differ from the numba quantizer's only through the random stream; on inputs
that lie on the grid they are the same; elsewhere they are checked to be on the grid, within
one step, and unbiased.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
# conftest.py set TRITON_INTERPRET=1 (no GPU) before anything imported triton.
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "run these tests through pytest (conftest.py)"

pytest.importorskip("triton", reason="the gpu extra (triton) is not installed")

from tail_ray.bitwidth.quant_error import bucket_errors  # noqa: E402
from tail_ray.compression import device_codec as dc  # noqa: E402
from tail_ray.compression.bitpack import packed_bytes  # noqa: E402
from tail_ray.compression.codes import LevelStats  # noqa: E402
from tail_ray.compression.dense_codes import BitPackCode  # noqa: E402
from tail_ray.compression.device import BACKEND_ENV, DeviceFlat, uses_triton  # noqa: E402
from tail_ray.compression.fixedsum import sum_squares  # noqa: E402
from tail_ray.compression.grid import dequantize_reference, levels_max, scales_up_reference  # noqa: E402
from tail_ray.compression.qsgd import QSGDCompressor, QSGDConfig  # noqa: E402
from tail_ray.compression.quantize import (  # noqa: E402
    quantize,
    quantize_ef,
    quantize_finite,
)
from tail_ray.compression.rank_mean import mean_dequantized_into  # noqa: E402
from tail_ray.compression.records import Kind, QuantRecord  # noqa: E402
from tail_ray.compression.rounding import ROUNDINGS  # noqa: E402
from tail_ray.compression.tail import TailCompressor, TailConfig  # noqa: E402
from tail_ray.compression.wire import decode_payload, encode_payload  # noqa: E402
from tail_ray.errors import ConfigError  # noqa: E402
from tests.compression.scale_edges import edge_max_abs  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def _dev(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True)).to(DEV)  # never aliases the test's array


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _grad(n: int, seed: int, *, zero_bucket: tuple[int, int] | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * rng.uniform(0.01, 3.0)).astype(np.float32)
    if zero_bucket is not None:
        g[zero_bucket[0] : zero_bucket[1]] = 0.0
    return g


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compressors send every (CPU) tensor through the Triton kernels."""
    monkeypatch.setenv(BACKEND_ENV, "triton")


# --------------------------------------------------------------------------- kernels


def test_kernel_constants_are_the_grids() -> None:
    from tail_ray.compression import fixedsum, grid
    from tail_ray.compression import triton_kernels as K

    assert K.LANES.value == fixedsum.LANES
    assert np.float32(K.F32_MAX.value) == grid.F32_MAX and K.F32_MAX.value == float(grid.F32_MAX)
    assert K.TINY_SCALE.value == float(grid.TINY_SCALE) and K.TINY_PRESCALE.value == float(grid.TINY_PRESCALE)
    assert K.SCALE_LOW_MASK.value == grid.SCALE_LOW_MASK and K.MAX_SCALE_BITS.value == grid.MAX_SCALE_BITS
    assert K.SCALE_KEEP_MASK.value == 0x7FFFFFFF & ~grid.SCALE_LOW_MASK


@pytest.mark.parametrize("rounding", ["stochastic", "nearest", "dither"])
def test_scales_round_up_onto_the_16_bit_grid_as_on_the_cpu_at_the_edges(rounding: str) -> None:
    """Bucket max-abs values at the grid's edges (on it, one ulp either side, float32's max
    and past the grid's largest value, subnormals): the device's scales are the reference's."""
    tops = edge_max_abs()
    g = np.repeat(tops * np.float32(0.25), 8)
    g[::8] = -tops  # the max-abs, negative: its sign must not reach the scale
    out = dc.quantize(DeviceFlat(_dev(g)), None, 4, 8, seed=3, rounding=rounding)
    np.testing.assert_array_equal(out.scales, scales_up_reference(tops))
    if rounding != "dither":  # (quantize_reference has no dither; test_triton_dither.py has)
        lv, sc, _ = dc.quantize_reference(g, None, 4, 8, 3, rounding)
        np.testing.assert_array_equal(out.levels, lv)
        np.testing.assert_array_equal(sc, out.scales)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])  # dither: test_triton_dither.py
@pytest.mark.parametrize(
    ("bits", "bucket", "n", "with_e"),
    [(4, 512, 2000, True), (2, 64, 1000, True), (8, 100, 700, True), (3, 256, 900, False), (5, 8, 203, True)],
)
def test_quantize_kernel_is_the_reference_bit_for_bit(
    bits: int, bucket: int, n: int, with_e: bool, rounding: str
) -> None:
    g = _grad(n, bits, zero_bucket=(0, bucket))  # bucket 0 all zero: scale 0, levels 0
    e = (0.05 * _grad(n, 100 + bits)) if with_e else None
    res = _dev(e) if e is not None else None
    out = dc.quantize(DeviceFlat(_dev(g)), res, bits, bucket, seed=0xDEADBEEF, rounding=rounding)
    lv, sc, e_new = dc.quantize_reference(g, e, bits, bucket, 0xDEADBEEF, rounding)
    assert out.levels.dtype == np.int8
    np.testing.assert_array_equal(out.levels, lv)
    np.testing.assert_array_equal(out.scales, sc)
    assert out.nnz == int(np.count_nonzero(lv))
    # What crossed the bus: the bit-packed levels and the scales, nothing else.
    assert out.transferred_bytes == packed_bytes(n, bits) + 4 * sc.size
    if with_e:
        assert res is not None and e_new is not None
        np.testing.assert_array_equal(_host(res), e_new)
        assert out.err_sq == pytest.approx(float(np.sum(e_new.astype(np.float64) ** 2)), rel=1e-12)


def test_scales_and_residual_are_the_cpu_paths() -> None:
    """Scales do not depend on the random stream: the numba kernel's, bit for bit; the
    residual is x - the grid's decoded value of the levels the device chose, bit for bit."""
    bits, bucket, n = 4, 128, 1500
    g, e = _grad(n, 1), 0.1 * _grad(n, 2)
    e_cpu = e.copy()
    lv_cpu = np.empty(n, np.int8)
    sc_cpu = np.empty(-(-n // bucket), np.float32)
    quantize_ef(g, e_cpu, bits, bucket, 7, lv_cpu, sc_cpu)
    res = _dev(e)
    out = dc.quantize(DeviceFlat(_dev(g)), res, bits, bucket, seed=7)
    np.testing.assert_array_equal(out.scales, sc_cpu)
    x = np.clip(g + e, -3.4e38, 3.4e38).astype(np.float32)
    np.testing.assert_array_equal(_host(res), x - dequantize_reference(out.levels, out.scales, bits, bucket))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_levels_on_the_grid_within_one_step(bits: int) -> None:
    bucket, n = 256, 1024
    g = _grad(n, 3 + bits)
    out = dc.quantize(DeviceFlat(_dev(g)), None, bits, bucket, seed=bits)
    lmax = levels_max(bits)
    assert out.levels.min() >= -lmax and out.levels.max() <= lmax
    step = np.repeat(out.scales * np.float32(1.0 / lmax), bucket)[:n].astype(np.float64)
    ratio = g.astype(np.float64) / step
    # Stochastic rounding picks floor or ceil of x / step: within one step of the value.
    assert np.all((out.levels >= np.floor(ratio) - 1e-6) & (out.levels <= np.ceil(ratio) + 1e-6))


@pytest.mark.parametrize("seed", [0, 1, 0xFFFFFFFF])
def test_on_grid_inputs_give_the_cpu_levels_exactly(seed: int) -> None:
    """Values k * 2^-3 in buckets of scale L * 2^-3: every product is exact, y = k, and both
    backends' rounding (floor(k + u), u < 1) returns k whatever their random streams."""
    bits, bucket, n = 4, 64, 640
    lmax = levels_max(bits)
    rng = np.random.default_rng(seed)
    k = rng.integers(-lmax, lmax + 1, n)
    k[::bucket] = lmax  # every bucket reaches the scale
    g = (k * 2.0**-3).astype(np.float32)
    out = dc.quantize(DeviceFlat(_dev(g)), _dev(np.zeros(n, np.float32)), bits, bucket, seed)
    lv_cpu, sc_cpu = np.empty(n, np.int8), np.empty(n // bucket, np.float32)
    quantize_ef(g, np.zeros(n, np.float32), bits, bucket, seed ^ 0x5A5A, lv_cpu, sc_cpu)
    np.testing.assert_array_equal(out.levels, k.astype(np.int8))
    np.testing.assert_array_equal(out.levels, lv_cpu)


def test_rounding_is_unbiased() -> None:
    """Each bucket holds its scale once and one value v 511 times: the mean level of those is
    v / step within 5 standard errors of stochastic rounding (sqrt(f (1 - f) / 511))."""
    bits, bucket = 3, 512
    lmax = levels_max(bits)
    fracs = [0.03, 0.25, 0.5, 0.71, 0.97, 0.4, 0.1, 0.9]
    g = np.empty(bucket * len(fracs), np.float32)
    for j, f in enumerate(fracs):
        g[j * bucket] = 1.0
        g[j * bucket + 1 : (j + 1) * bucket] = np.float32((1 + f) / lmax)  # step = 1 / L
    out = dc.quantize(DeviceFlat(_dev(g)), None, bits, bucket, seed=12345)
    for j, f in enumerate(fracs):
        body = out.levels[j * bucket + 1 : (j + 1) * bucket].astype(np.float64)
        assert set(np.unique(body)) <= {1.0, 2.0}
        assert abs(body.mean() - (1 + f)) < 5 * np.sqrt(f * (1 - f) / body.size)


def test_random_stream_is_uniform_and_differs_by_seed() -> None:
    idx = np.arange(1 << 18)
    a, b = dc.uniform_reference(1, idx), dc.uniform_reference(2, idx)
    for u in (a, b):
        assert u.min() >= 0.0 and u.max() < 1.0
        assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
        counts = np.bincount((u * 16).astype(np.int64), minlength=16)
        chi2 = float(((counts - u.size / 16) ** 2 / (u.size / 16)).sum())
        assert chi2 < 40.0  # 15 degrees of freedom: p ~ 5e-4
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_packing_is_the_wire_bitpack_body(bits: int) -> None:
    n = 203  # not a multiple of 8: the last group is partial
    lmax = levels_max(bits)
    lv = np.random.default_rng(bits).integers(-lmax, lmax + 1, n).astype(np.int8)
    packed = _host(dc.pack_levels(_dev(lv), bits))
    _, body = BitPackCode().encode(LevelStats(lv, bits))
    assert packed.tobytes() == body
    # and back: the device dequantizer reads what it packed as the grid says
    scales = np.abs(np.random.default_rng(9).standard_normal(-(-n // 16))).astype(np.float32)
    values = dc.dequantize(_dev(packed), _dev(scales), bits, 16, n)
    np.testing.assert_array_equal(_host(values), dequantize_reference(lv, scales, bits, 16))


def test_fused_packing_equals_the_pack_kernel() -> None:
    """Buckets of a multiple of 8 pack inside the quantizer; others go through _pack_kernel."""
    g = _grad(777, 5)
    fused = dc.quantize_device(DeviceFlat(_dev(g)), None, 4, 64, 3)[0]
    lv, _, _ = dc.quantize_reference(g, None, 4, 64, 3)
    assert _host(fused).tobytes() == _host(dc.pack_levels(_dev(lv), 4)).tobytes()


@pytest.mark.parametrize(
    ("bits", "bucket", "with_e"),
    [(4, 512, True), (2, 64, True), (3, 100, False), (8, 8, True), (5, 256, False)],
)
def test_nearest_levels_are_the_cpu_kernels_bit_for_bit(bits: int, bucket: int, with_e: bool) -> None:
    """Round-to-nearest has no random stream: the device's levels, scales, residual, non-zero
    count and ||e'||^2 are the numba kernel's exactly, ties and the 2^64 prescale included."""
    n = 5 * bucket + bucket // 2 + 3  # a partial last bucket
    g = _grad(n, 40 + bits, zero_bucket=(bucket, 2 * bucket))  # bucket 1 all zero
    g[2 * bucket : 3 * bucket] *= np.float32(2.0**-70)  # bucket 2 below TINY_SCALE
    lmax = levels_max(bits)
    # bucket 3: exact halves between levels, where only the tie rule (away from zero) decides.
    # Its max |x| is L, so the step is 1 and t = |x| exactly.
    tie = g[3 * bucket : 4 * bucket]
    tie[:] = (np.arange(tie.size) % (2 * lmax) - lmax + 0.5).astype(np.float32)
    tie[0] = np.float32(lmax)
    e = 0.05 * _grad(n, 60 + bits) if with_e else None
    if e is not None:
        e[bucket : 4 * bucket] = 0.0  # keep the zero, tiny and tie buckets as they are
    res = _dev(e) if e is not None else None
    out = dc.quantize(DeviceFlat(_dev(g)), res, bits, bucket, seed=1, rounding="nearest")
    lv = np.empty(n, np.int8)
    sc = np.empty(-(-n // bucket), np.float32)
    if res is not None and e is not None:
        e_cpu = e.copy()
        nnz, err_sq = quantize_finite(g, e_cpu, bits, bucket, 2, lv, sc, rounding="nearest")  # seed unused
        np.testing.assert_array_equal(_host(res), e_cpu)
        assert out.err_sq == pytest.approx(err_sq, rel=1e-12)  # per-bucket partials: another order
    else:
        nnz = quantize(g, bits, bucket, 2, lv, sc, rounding="nearest")
    np.testing.assert_array_equal(out.levels, lv)
    np.testing.assert_array_equal(out.scales, sc)
    assert out.nnz == int(nnz) == int(np.count_nonzero(lv))
    # The tie bucket rounded away from zero: |level| = floor(|t|) + 1 wherever t is a half.
    t_abs = np.abs(tie.astype(np.float64))
    halves = t_abs % 1 == 0.5
    assert halves.sum() > tie.size // 2
    np.testing.assert_array_equal(np.abs(lv[3 * bucket : 4 * bucket][halves]), np.floor(t_abs[halves]) + 1)


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("with_e", [True, False])
def test_controller_statistics_are_the_cpu_bits(with_e: bool, rounding: str) -> None:
    bucket, n = 128, 1100  # last bucket partial (76 elements: a lane tail)
    g = _grad(n, 11, zero_bucket=(256, 384))  # bucket 2 all zero
    g[640:768] *= np.float32(2.0**-70)  # bucket 5 below TINY_SCALE: the 2^64 prescale path
    e = 0.2 * _grad(n, 12) if with_e else None
    if e is not None:
        e[256:384] = 0.0
        e[640:768] *= np.float32(2.0**-70)
    ids = np.array([8, 2, 5, 0, 3], dtype=np.int64)
    cands = (2, 3, 4, 5, 6, 8)
    got = dc.bucket_errors(
        DeviceFlat(_dev(g)), _dev(e) if e is not None else None, bucket, ids, cands, rounding
    )
    want = bucket_errors(g, e, bucket, ids, cands, rounding)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1] and got[2] == want[2] == 4


def test_sum_squares_and_finiteness() -> None:
    g = _grad(3000, 4)
    assert dc.sum_squares(DeviceFlat(_dev(g))) == pytest.approx(float(sum_squares(g)), rel=1e-12)
    g[1234] = np.inf
    assert not np.isfinite(dc.sum_squares(DeviceFlat(_dev(g))))


def test_rank_mean_on_the_device_is_the_cpu_mean() -> None:
    n = 900
    rng = np.random.default_rng(6)
    specs = [(4, 128), (2, 100), (8, 900)]  # ranks may differ in bits and bucket size
    levels, scales = [], []
    for bits, bucket in specs:
        lmax = levels_max(bits)
        levels.append(rng.integers(-lmax, lmax + 1, n).astype(np.int8))
        scales.append(np.abs(rng.standard_normal(-(-n // bucket))).astype(np.float32))
    for lv, sc in zip(levels, scales, strict=True):  # -1 * 0.0 = -0.0 on every rank: the mean
        lv[:5] = -1  # keeps its sign only if rank 0's value starts the sum (0.0 + -0.0 = +0.0)
        sc[0] = 0.0
    want = np.empty(n, np.float32)
    bits_l, buckets = [b for b, _ in specs], [s for _, s in specs]
    mean_dequantized_into(levels, scales, bits_l, buckets, want)
    out = torch.full((n,), 7.0, device=DEV)
    dc.mean_into(levels, scales, bits_l, buckets, out)
    assert _host(out).tobytes() == want.tobytes()
    assert np.signbit(_host(out)[:5]).all()


# --------------------------------------------------------------------------- the compressors


def _layers(seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        "fc1.weight": torch.from_numpy((rng.standard_normal((40, 128)) * 0.02).astype(np.float32)).to(DEV),
        "fc1.bias": torch.from_numpy(rng.standard_normal(40).astype(np.float32)).to(DEV),
        "fc2.weight": torch.from_numpy((rng.standard_normal(4200) * 3.0).astype(np.float32)).to(DEV),
    }


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(8)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert not uses_triton(cpu)  # auto: CPU tensors stay on numba
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    assert not uses_triton(cpu)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        uses_triton(cpu)
    monkeypatch.setenv(BACKEND_ENV, "gpu")
    with pytest.raises(ConfigError, match="auto, cpu, triton"):
        uses_triton(cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_gradients_stay_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default settings, CUDA gradients: the Triton backend is chosen by itself, residuals
    live on the GPU, and the mean is written into the CUDA gradients."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert uses_triton(torch.zeros(8, device="cuda"))
    comp = TailCompressor(TailConfig(seed=3))
    grads = _layers(7)
    payload = comp.compress(grads)
    assert comp.feedback is not None
    assert comp.feedback.device_buffer("fc1.weight", 5120, DEV).device.type == "cuda"
    comp.aggregate([payload], grads, own=0)
    assert all(g.device.type == "cuda" and torch.isfinite(g).all() for g in grads.values())


@pytest.mark.usefixtures("triton_backend")
def test_tail_payload_is_the_cpu_wire_format() -> None:
    """A payload made on the device decodes with the CPU decoder to the records sent, and the
    CPU encoder turns those levels into the very same bytes."""
    comp = TailCompressor(TailConfig(seed=5, sample_numel=1024))
    grads = _layers(1)
    payload = comp.compress(grads)
    own = comp._own_records
    assert own is not None and isinstance(own[0], QuantRecord)
    assert isinstance(comp.feedback and comp.feedback.device_buffer("fc1.weight", 5120, DEV), torch.Tensor)
    assert encode_payload(own)[0] == payload
    decoded = decode_payload(payload)
    for a, b in zip(own, decoded, strict=True):
        assert a.name == b.name
        if isinstance(a, QuantRecord):
            assert isinstance(b, QuantRecord) and a.bits == b.bits
            np.testing.assert_array_equal(a.levels, b.levels)
            np.testing.assert_array_equal(a.scales, b.scales)
    # Raw records: the small layers as float16 (16), anything else fp32 (32).
    want = [r.bits if isinstance(r, QuantRecord) else 16 if getattr(r, "fp16", False) else 32 for r in own]
    assert [s.bits for s in comp.last_stats] == want


def test_tail_decides_the_same_bits_on_both_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same seed, same gradients: the controller's sampled statistics are the same bits on
    either backend, so it picks the same bit-widths and the scales agree (step 0: no residual
    yet; from step 1 on the residuals differ by stochastic rounding's random stream; nearest's
    whole payloads agree: test_the_default_rounds_to_nearest_and_both_backends_send_the_same_bytes)."""
    bits_by_backend = {}
    for backend in ("cpu", "triton"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        config = TailConfig(seed=9, sample_numel=512, redecide_every_steps=1, rounding="stochastic")
        comp = TailCompressor(config)
        bits, scales = [], []
        for step in range(1):
            comp.compress(_layers(10 + step))
            recs = [r for r in comp._own_records or [] if isinstance(r, QuantRecord)]
            bits.append([r.bits for r in recs])
            scales.append([r.scales for r in recs])
        bits_by_backend[backend] = (bits, scales)
    assert bits_by_backend["cpu"][0] == bits_by_backend["triton"][0]
    for a, b in zip(bits_by_backend["cpu"][1][0], bits_by_backend["triton"][1][0], strict=True):
        np.testing.assert_array_equal(a, b)  # step 0: no residual yet, same inputs


@pytest.mark.parametrize("rounding", ["auto", "nearest"])
def test_both_backends_send_the_same_bytes(monkeypatch: pytest.MonkeyPatch, rounding: str) -> None:
    """Dither (the default) draws the CPU's uniforms and nearest has no random stream, and the
    controller's statistics are the same bits, so over several steps (residuals,
    re-decisions, the whole-model allocation) the Triton path sends the CPU path's payloads
    byte for byte; stochastic rounding sends other bytes. Low-rank is off: it runs on host
    arrays only."""

    def payloads(backend: str, rounding: str) -> list[bytes]:
        monkeypatch.setenv(BACKEND_ENV, backend)
        config = TailConfig(
            seed=9, sample_numel=512, lowrank="off", redecide_every_steps=1, rounding=rounding
        )
        comp = TailCompressor(config)
        return [comp.compress(_layers(20 + step)) for step in range(4)]

    device = payloads("triton", rounding)
    assert device == payloads("cpu", rounding)
    assert device != payloads("triton", "stochastic")
    kinds = {rec.kind for p in device for rec in decode_payload(p) if isinstance(rec, QuantRecord)}
    assert kinds == ({Kind.QUANT_DITHER} if rounding == "auto" else {Kind.QUANT})


@pytest.mark.usefixtures("triton_backend")
def test_aggregate_on_the_device_matches_the_cpu_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = [QSGDCompressor(QSGDConfig(bits=4, seed=r)) for r in range(2)]
    payloads = [c.compress(_layers(20 + r)) for r, c in enumerate(ranks)]
    into = {k: torch.zeros_like(v) for k, v in _layers(0).items()}
    ranks[0].aggregate(payloads, into, own=0)
    monkeypatch.setenv(BACKEND_ENV, "cpu")
    want = {k: torch.zeros(v.shape) for k, v in _layers(0).items()}
    QSGDCompressor(QSGDConfig(bits=4, seed=0)).aggregate(payloads, want)
    for name in want:
        assert _host(into[name]).tobytes() == want[name].numpy().tobytes(), name


@pytest.mark.usefixtures("triton_backend")
def test_nonfinite_layer_goes_raw_and_keeps_its_residual() -> None:
    comp = QSGDCompressor(QSGDConfig(bits=4, seed=1, error_feedback=True))
    grads = _layers(3)
    comp.compress(grads)
    assert comp.feedback is not None
    before = _host(comp.feedback.device_buffer("fc2.weight", 4200, DEV)).copy()
    grads["fc2.weight"][17] = float("nan")
    comp.compress(grads)
    rec = next(r for r in comp._own_records or [] if r.name == "fc2.weight")
    assert not isinstance(rec, QuantRecord)
    np.testing.assert_array_equal(_host(comp.feedback.device_buffer("fc2.weight", 4200, DEV)), before)
    # the checkpoint holds host copies of device residuals
    assert comp.state_dict()["residuals"]["fc2.weight"].device.type == "cpu"


@pytest.mark.usefixtures("triton_backend")
def test_the_collective_path_runs_unchanged_on_the_triton_backend() -> None:
    """The hook layer's world-size-1 round trip (compress -> aggregate into the gradients)
    with the Triton backend: gradients change to their quantized mean, metrics are recorded."""
    from tail_ray.collective import compress_gradients_locally, make_hook_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.ReLU(), torch.nn.Linear(80, 8)).to(DEV)
    state = make_hook_state(model, "tail", {"seed": 4})
    model(torch.randn(16, 64, device=DEV)).square().mean().backward()
    w = model[0].weight
    assert w.grad is not None
    before = w.grad.detach().clone()
    compress_gradients_locally(state, model)
    after = w.grad.detach()
    assert after.device == before.device and not torch.equal(after, before)
    lmax = levels_max(max(s.bits for s in state.drain_metrics().layers if s.layer == "0.weight"))
    # every value within one grid step (scale / L) of the gradient, bucket by bucket
    step = before.reshape(-1, 512).abs().amax(dim=1, keepdim=True) * (1 + 2.0**-8) / lmax  # scale rounded up
    assert ((after.reshape(-1, 512) - before.reshape(-1, 512)).abs() <= step * (1 + 1e-6)).all()


@pytest.mark.usefixtures("triton_backend")
def test_buckets_too_big_for_one_program_are_quantized_on_the_host(caplog: pytest.LogCaptureFixture) -> None:
    from tail_ray.compression.device import MAX_DEVICE_BUCKET

    with pytest.raises(ValueError, match=r"buckets of 1\.\."):
        dc.quantize_device(DeviceFlat(_dev(np.ones(8, np.float32))), None, 4, MAX_DEVICE_BUCKET + 1, 0)
    big = MAX_DEVICE_BUCKET * 2
    comp = QSGDCompressor(QSGDConfig(bits=4, bucket_size=big, seed=2, error_feedback=True))
    g = _grad(3 * MAX_DEVICE_BUCKET, 8)
    with caplog.at_level("WARNING"):
        payload = comp.compress({"w": _dev(g)})
    assert "quantized on the host" in caplog.text
    (rec,) = decode_payload(payload)
    assert isinstance(rec, QuantRecord) and rec.bucket_size == big
    max_abs = np.array([np.abs(g[:big]).max(), np.abs(g[big:]).max()], np.float32)
    np.testing.assert_array_equal(rec.scales, scales_up_reference(max_abs))
