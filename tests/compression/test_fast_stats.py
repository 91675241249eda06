"""The fast counting pass for large layers (level_histograms.pair_level_stats_fast).

The own-payload shortcut (a compressor's ``aggregate`` takes its own records instead of
decoding its own payload) is tested in tests/collective/test_decode_average.py."""

import numpy as np
import pytest

from tail_ray.compression import code_table, sparse
from tail_ray.compression import level_histograms as hist
from tail_ray.compression.code_table import Code
from tail_ray.compression.grid import levels_max
from tail_ray.errors import CodecError

N_LARGE = hist.GAP_EXACT_NUMEL + 12345  # above the exact-gap size, odd tail on purpose


def _levels(n: int, half: int, density: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lv = rng.integers(-half, half + 1, size=n).astype(np.int8)
    lv[rng.random(n) >= density] = 0
    return lv


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [N_LARGE, N_LARGE + 1])
def test_fast_stats_exact_counts_and_pairs(bits: int, n: int) -> None:
    half = levels_max(bits)
    lv = _levels(n, half, 0.6, seed=bits + n)
    c_ref = np.zeros(2 * half + 1, np.int64)
    s_ref = np.zeros(sparse.N_SLOTS, np.int64)
    nnz, extra, syms, pc = hist.pair_level_stats(lv, half, c_ref, s_ref)
    c = np.zeros_like(c_ref)
    s = np.zeros_like(s_ref)
    nnz_f, extra_f, syms_f, pc_f, exact = hist.pair_level_stats_fast(lv, half, c, s)
    assert not exact
    assert nnz_f == nnz == np.count_nonzero(lv)
    np.testing.assert_array_equal(c, c_ref)
    np.testing.assert_array_equal(syms_f, syms)
    np.testing.assert_array_equal(pc_f, pc)
    # Sampled gap statistics: an estimate of the exact histogram (same total, close shares).
    assert abs(int(s.sum()) - nnz) <= 0.02 * nnz
    assert abs(extra_f - extra) <= 0.1 * extra + 64
    np.testing.assert_allclose(s[:7] / s.sum(), s_ref[:7] / s_ref.sum(), atol=0.02)


def test_fast_stats_small_layer_is_exact() -> None:
    lv = _levels(5000, 3, 0.5, seed=1)
    c = np.zeros(7, np.int64)
    s = np.zeros(sparse.N_SLOTS, np.int64)
    *_, exact = hist.pair_level_stats_fast(lv, 3, c, s)
    assert exact


@pytest.mark.parametrize("bad", [-4, 4, -128, 127])
def test_fast_stats_rejects_out_of_range_levels(bad: int) -> None:
    lv = _levels(N_LARGE, 3, 0.5, seed=2)
    lv[N_LARGE // 3] = bad
    c = np.zeros(7, np.int64)
    s = np.zeros(sparse.N_SLOTS, np.int64)
    assert hist.pair_level_stats_fast(lv, 3, c, s)[0] == -1
    with pytest.raises(CodecError):
        code_table.encode_levels(lv, 3)


def test_large_clustered_layer_goes_sparse_and_round_trips() -> None:
    # Dead units: whole zero rows. The sampled estimate must still find the sparse code, and
    # the sparse body (built from exact gap counts) must decode to the same levels.
    rows, cols = 512, 512
    lv = _levels(rows * cols, 3, 0.9, seed=3).reshape(rows, cols)
    lv[np.random.default_rng(4).random(rows) < 0.8] = 0
    lv = lv.reshape(-1)
    code, nnz, body = code_table.encode_levels(lv, 3)
    assert code == Code.SPARSE_RANS
    out = code_table.decode_levels(code, np.frombuffer(body, np.uint8), lv.size, 3, nnz, layer="x")
    np.testing.assert_array_equal(out, lv)
    forced = code_table.encode_levels(lv, 3, force=Code.SPARSE_RANS)
    assert forced == (code, nnz, body)


@pytest.mark.parametrize("density", [0.05, 0.6, 1.0])
def test_large_layer_round_trips_every_code(density: float) -> None:
    lv = _levels(N_LARGE, 7, density, seed=5)
    for code in code_table.candidate_codes(4, lv.size):
        c, nnz, body = code_table.encode_levels(lv, 4, force=code)
        out = code_table.decode_levels(c, np.frombuffer(body, np.uint8), lv.size, 4, nnz, layer="x")
        np.testing.assert_array_equal(out, lv)


@pytest.mark.parametrize("bits", [5, 8])
def test_fast_level_stats_exact_counts_sampled_gaps(bits: int) -> None:
    half = levels_max(bits)
    lv = _levels(N_LARGE, half, 0.5, seed=bits)
    c_ref = np.zeros(2 * half + 1, np.int64)
    s_ref = np.zeros(sparse.N_SLOTS, np.int64)
    nnz, extra = hist.level_stats(lv, half, c_ref, s_ref)
    c = np.zeros_like(c_ref)
    s = np.zeros_like(s_ref)
    nnz_f, extra_f, exact = hist.level_stats_fast(lv, half, c, s)
    assert not exact and nnz_f == nnz
    np.testing.assert_array_equal(c, c_ref)
    assert abs(int(s.sum()) - nnz) <= 0.02 * nnz
    assert abs(extra_f - extra) <= 0.1 * extra + 64
    lv[7] = half + 1 if half < 127 else -128  # outside [-L, L] (int8 -128 for bits 8)
    assert hist.level_stats_fast(lv, half, c, s)[0] == -1
    with pytest.raises(CodecError):
        code_table.encode_levels(lv, bits)


@pytest.mark.parametrize("bits", [6, 8])
def test_large_wide_layer_round_trips_every_code(bits: int) -> None:
    half = levels_max(bits)
    for density in (0.02, 0.7):
        lv = _levels(N_LARGE, half, density, seed=bits)
        for code in (None, *code_table.candidate_codes(bits, lv.size)):
            c, nnz, body = code_table.encode_levels(lv, bits, force=code)
            out = code_table.decode_levels(c, np.frombuffer(body, np.uint8), lv.size, bits, nnz, layer="x")
            np.testing.assert_array_equal(out, lv)


def test_branch_free_gap_window_counts_what_the_branchy_one_counts() -> None:
    rng = np.random.default_rng(13)
    for trial in range(300):
        n = int(rng.integers(1, 20_000))
        lv = _levels(n, 3, float(rng.random()) ** 2, seed=trial)
        if trial % 4 == 0:  # a long leading run of zeros, and windows that hold few non-zeros
            lv[: int(rng.integers(0, n))] = 0
        lo = int(rng.integers(0, n))
        hi = int(rng.integers(lo, n + 1))
        want_slots, want_g = np.zeros(sparse.N_SLOTS, np.int64), np.zeros(8, np.int64)
        got_slots, got_g = np.zeros(sparse.N_SLOTS, np.int64), np.zeros(8, np.int64)
        want = hist._gap_window(lv, lo, hi, want_slots, want_g)
        got = hist._gap_window_dense(lv, lo, hi, got_slots, got_g)
        assert got == want
        np.testing.assert_array_equal(got_slots, want_slots)
        np.testing.assert_array_equal(got_g, want_g)


@pytest.mark.parametrize("density", [0.05, hist.DENSE_GAP_SHARE - 0.01, hist.DENSE_GAP_SHARE + 0.01, 0.6])
def test_sampled_gaps_equal_the_windowed_count_on_both_sides_of_the_dense_switch(density: float) -> None:
    """The switch to the branch-free counter changes speed only: the estimate (and so the code
    chosen and the payload) is what the branchy window count gives."""
    lv = _levels(1 << 20, 3, density, seed=int(density * 100))
    nnz = int(np.count_nonzero(lv))
    got_slots = np.zeros(sparse.N_SLOTS, np.int64)
    got_extra = hist.sampled_gaps(lv, nnz, got_slots)
    slots, g = np.zeros(sparse.N_SLOTS, np.int64), np.zeros(8, np.int64)
    counted = extra = 0
    step = hist.GAP_WINDOW * hist.GAP_SAMPLE_EVERY
    for lo in range((lv.size % step) // 2, lv.size, step):
        c, e = hist._gap_window(lv, lo, min(lv.size, lo + hist.GAP_WINDOW), slots, g)
        counted, extra = counted + c, extra + e
    slots[:7] += g[:7]
    want_slots = np.where(slots > 0, np.maximum((slots * nnz) // counted, 1), 0)
    assert got_extra == (extra * nnz) // counted
    np.testing.assert_array_equal(got_slots, want_slots)
