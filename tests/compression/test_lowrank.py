"""Low-rank layers: the LOWRANK record kind on the wire, exact error feedback, and the choice
between low-rank and quantization (tail_ray/compression/lowrank*.py, bitwidth/lowrank_choice.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from tail_ray.bitwidth.lowrank_rows import rows_lost_share
from tail_ray.compression.lowrank import compress_lowrank, factor_bytes, matrix_shape, max_rank, reconstruct
from tail_ray.compression.records import Kind, LowRankRecord, QuantRecord, RawRecord
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.compression.varint import varint
from tail_ray.compression.wire import SCALES_16, decode_payload, encode_payload, seal
from tail_ray.errors import CodecError, ConfigError


def _record(rows: int, cols: int, rank: int, bits: int = 8, bucket: int = 64, seed: int = 0) -> LowRankRecord:
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((rows, cols)).astype(np.float32).reshape(-1)
    q = torch.from_numpy(rng.standard_normal((cols, rank)).astype(np.float32))
    rec, _q, _recon = compress_lowrank("w", m, rows, cols, q, bits=bits, bucket_size=bucket, seed=seed)
    return rec


def test_matrix_shape_and_rank_bounds() -> None:
    assert matrix_shape((32, 16, 3, 3)) == (32, 144)
    assert matrix_shape((128, 512)) == (128, 512)
    assert matrix_shape((512,)) is None
    assert max_rank(128, 512) == min(128, (128 * 512 - 1) // 640)
    assert max_rank(4096, 1) == 0  # a column: factors never hold fewer numbers


@pytest.mark.parametrize(
    ("rows", "cols", "rank", "bits"), [(32, 144, 4, 8), (128, 512, 8, 8), (40, 24, 3, 4)]
)
def test_lowrank_record_round_trips_bit_exactly(rows: int, cols: int, rank: int, bits: int) -> None:
    rec = _record(rows, cols, rank, bits)
    payload, costs = encode_payload([rec, RawRecord("b", np.arange(5, dtype=np.float32))])
    assert costs[0].code == "lowrank" and sum(c.encoded_bytes for c in costs) + 16 == len(payload)
    got = decode_payload(payload, max_numel=rows * cols + 5)
    back = got[0]
    assert isinstance(back, LowRankRecord) and back.kind == Kind.LOWRANK
    assert (back.name, back.rows, back.cols, back.rank, back.bits, back.bucket_size) == (
        "w",
        rows,
        cols,
        rank,
        bits,
        rec.bucket_size,
    )
    for a, b in (
        (back.p_levels, rec.p_levels),
        (back.q_levels, rec.q_levels),
        (back.p_scales, rec.p_scales),
        (back.q_scales, rec.q_scales),
    ):
        assert np.array_equal(a, b)
    assert np.array_equal(reconstruct(back), reconstruct(rec))
    # Fewer bytes than the matrix's numbers at the factors' bits (bit-packing is the ceiling).
    assert costs[0].encoded_bytes <= factor_bytes(rows, cols, rank, bits, rec.bucket_size) + len("w")


def test_reconstruction_is_the_product_of_the_decoded_factors() -> None:
    rec = _record(24, 40, 3)
    from tail_ray.compression.lowrank import factors

    p, q = factors(rec)
    want = (p.reshape(3, 24).astype(np.float64).T @ q.reshape(3, 40).astype(np.float64)).astype(np.float32)
    np.testing.assert_allclose(reconstruct(rec).reshape(24, 40), want, rtol=1e-6, atol=1e-7)


def _layer_body_offset(payload: bytes) -> tuple[int, int]:
    """(offset of the first layer's body, its length) in a payload."""
    from tail_ray.compression.varint import read_varint

    buf = np.frombuffer(payload, np.uint8)
    pos = 12
    name_len = payload[pos] | payload[pos + 1] << 8
    pos += 2 + name_len + 4
    values = []
    for field in ("numel", "bucket", "n_scales", "nnz", "body_len"):
        v, pos = read_varint(buf, pos, buf.size, layer=None, field=field)
        values.append(v)
    scale_width = 2 if payload[5] & SCALES_16 else 4  # the header's flags
    return pos + scale_width * values[2], values[4]


def _with_body(payload: bytes, body: bytes) -> bytes:
    """The first layer's body replaced (body_len re-written) and the payload re-sealed."""
    start, length = _layer_body_offset(payload)
    # body_len is the last varint before the scales: rebuild the layer header around it.
    frame = payload[:-4]
    buf = np.frombuffer(frame, np.uint8)
    from tail_ray.compression.varint import read_varint

    pos = 12
    name_len = frame[pos] | frame[pos + 1] << 8
    pos += 2 + name_len + 4
    for field in ("numel", "bucket", "n_scales", "nnz"):
        _v, pos = read_varint(buf, pos, buf.size, layer=None, field=field)
    _v, after = read_varint(buf, pos, buf.size, layer=None, field="body_len")
    scales = frame[after:start]
    return seal(frame[:pos] + varint(len(body)) + scales + body + frame[start + length :])


def _body(rows: int, rank: int, rest: bytes) -> bytes:
    return varint(rows) + varint(rank) + rest


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda b: _body(7, 3, b[2:]), "rows"),  # 7 does not divide 24 * 40
        (lambda b: _body(24, 0, b[2:]), "rank"),
        (lambda b: _body(24, 15, b[2:]), "rank"),  # above max_rank(24, 40) = 14
        (lambda b: _body(24, 4, b[2:]), "n_scales"),  # the scales sent are for rank 3
        (lambda b: b[:2], "p_code"),  # truncated after rows and rank
        (lambda b: b[:2] + bytes((2,)) + varint(0) + varint(1 << 20), "p_len"),
        (lambda b: b[:2] + bytes((0,)) + b[3:], "code"),  # raw cannot carry levels
        (lambda b: b[:-1], "body_len"),  # Q's bit-packed levels one byte short
    ],
)
def test_corrupt_lowrank_bodies_raise_codec_error_naming_the_field(edit, field: str) -> None:  # type: ignore[no-untyped-def]
    rec = _record(24, 40, 3, bits=8, bucket=64)
    payload, _ = encode_payload([rec])
    start, length = _layer_body_offset(payload)
    body = payload[start : start + length]
    assert body[:2] == bytes((24, 3))
    with pytest.raises(CodecError) as err:
        decode_payload(_with_body(payload, edit(body)), max_numel=24 * 40)
    assert err.value.layer == "w"
    assert err.value.field == field


def test_lowrank_bits_outside_2_to_8_are_codec_errors() -> None:
    payload, _ = encode_payload([_record(24, 40, 3)])
    frame = bytearray(payload[:-4])
    bits_at = 12 + 2 + 1 + 2  # header, name_len, "w", kind, code
    frame[bits_at] = 9
    with pytest.raises(CodecError) as err:
        decode_payload(seal(bytes(frame)))
    assert err.value.field == "bits"


def test_encoder_refuses_a_rank_that_saves_nothing() -> None:
    rec = _record(24, 40, 3)
    bad = LowRankRecord(
        "w", 24, 40, 20, rec.bits, rec.bucket_size, rec.p_scales, rec.p_levels, rec.q_scales, rec.q_levels
    )
    with pytest.raises(CodecError) as err:
        encode_payload([bad])
    assert err.value.field == "rank"


# --- error feedback and the choice, through TailCompressor ---------------------------------


def _low_rank_gradient(rows: int, cols: int, rank: int, step: int, noise: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    u, v = torch.randn(rows, rank, generator=gen), torch.randn(cols, rank, generator=gen)
    step_gen = torch.Generator().manual_seed(step)
    coeff = 1.0 + 0.1 * torch.randn(rank, generator=step_gen)
    return (u * coeff) @ v.T + noise * torch.randn(rows, cols, generator=step_gen)


def _tail(**extra) -> TailCompressor:  # type: ignore[no-untyped-def]
    config = {"lowrank": "on", "warmup_steps": 0, "redecide_every_steps": 4, "seed": 7} | extra
    return TailCompressor(TailConfig(**config))


def test_lowrank_needs_a_known_mode() -> None:
    with pytest.raises(ConfigError, match="lowrank"):
        TailConfig(lowrank="always")
    with pytest.raises(ConfigError, match="lowrank_ranks"):
        TailConfig(lowrank="auto", lowrank_ranks=(0, 2))
    with pytest.raises(ConfigError, match="lowrank_target"):
        TailConfig(lowrank="auto", lowrank_target="loose")
    with pytest.raises(ConfigError, match="lowrank_bits"):
        TailConfig(lowrank="auto", lowrank_bits=6.5)
    assert TailConfig(lowrank="auto", lowrank_bits=6.0, lowrank_ranks=[4, 2]).lowrank_ranks == (2, 4)
    # A job spec's `lowrank: off` / `lowrank: on` reach the config as YAML's False / True.
    assert TailConfig(lowrank=yaml.safe_load("lowrank: off")["lowrank"]).lowrank == "off"
    assert TailConfig(lowrank=yaml.safe_load("lowrank: on")["lowrank"]).lowrank == "on"
    with pytest.raises(ConfigError, match="lowrank must be one of"):
        TailConfig(lowrank=1)


def test_error_feedback_keeps_exactly_what_the_receivers_did_not_get() -> None:
    comp = _tail()
    seen_lowrank = 0
    for step in range(10):
        g = _low_rank_gradient(96, 160, 2, step, noise=0.05)
        e_before = (
            comp.feedback.buffer("w", g.numel()).copy() if comp.feedback and "w" in comp.feedback else None
        )
        payload = comp.compress({"w": g})
        (rec,) = decode_payload(payload)
        if not isinstance(rec, LowRankRecord):
            continue
        seen_lowrank += 1
        m = g.reshape(-1).numpy() + (e_before if e_before is not None else 0)
        m = m.astype(np.float32)
        sent = reconstruct(rec)
        e_after = comp.feedback.buffer("w", g.numel())
        # Bit for bit: the new residual is M minus the decoded reconstruction.
        assert np.array_equal(e_after, m - sent)
        assert comp.feedback.norm_sq("w") == pytest.approx(float(np.sum((m - sent).astype(np.float64) ** 2)))
        # And every receiver's mean gets exactly that reconstruction.
        into = {"w": torch.zeros_like(g)}
        comp.aggregate([payload], into, own=0)
        assert np.array_equal(into["w"].reshape(-1).numpy(), sent)
    assert seen_lowrank >= 5


def test_controller_picks_lowrank_where_cheaper_at_the_budget_and_quantization_where_not() -> None:
    low = _tail()
    full = _tail()
    gen = torch.Generator().manual_seed(5)
    for step in range(16):
        low.compress({"w": _low_rank_gradient(128, 256, 2, step, noise=0.01)})
        # A full-rank gradient (i.i.d. noise): a rank-16 trial keeps ~20 % of it, far from the
        # quantizer's residual at its budget's bits.
        full.compress({"w": torch.randn(128, 256, generator=gen)})
    assert low.lowrank is not None and full.lowrank is not None
    rank = low.lowrank.rank_of("w")
    assert rank in (2, 4)  # the smallest candidate rank that holds a rank-2 signal + noise
    assert low.last_stats[0].code == f"lowrank-r{rank}"
    assert full.lowrank.rank_of("w") == 0
    assert full.last_stats[0].code != "raw" and not full.last_stats[0].code.startswith("lowrank")
    # Low-rank sends less than the quantizer did for the same layer.
    quant_bytes = low.lowrank._layers["w"].quant_bytes
    assert quant_bytes is not None and low.last_stats[0].encoded_bytes < 0.5 * quant_bytes


def test_lowrank_leaves_when_its_measured_residual_exceeds_the_quantizers() -> None:
    comp = _tail()
    for step in range(8):
        comp.compress({"w": _low_rank_gradient(128, 256, 2, step, noise=0.01)})
    assert comp.lowrank is not None and comp.lowrank.rank_of("w") > 0
    gen = torch.Generator().manual_seed(9)
    ranks = []
    for _ in range(30):  # the gradient turns full-rank: no rank holds it at the budget
        comp.compress({"w": torch.randn(128, 256, generator=gen)})
        ranks.append(comp.lowrank.rank_of("w"))
    assert ranks[-1] == 0
    assert isinstance(
        decode_payload(comp.compress({"w": torch.randn(128, 256, generator=gen)}))[0], QuantRecord
    )


def test_vectors_and_small_layers_are_never_lowrank() -> None:
    comp = _tail()
    for step in range(10):
        comp.compress(
            {
                "v": torch.randn(8192, generator=torch.Generator().manual_seed(step)),
                "col": _low_rank_gradient(8192, 1, 1, step),
            }
        )
    assert comp.lowrank is not None
    assert comp.lowrank.ranks() == {}
    assert all(not st.code.startswith("lowrank") for st in comp.last_stats)


def _codes_over(comp: TailCompressor, steps: int) -> list[str]:
    codes = []
    for step in range(steps):
        comp.compress({"w": _low_rank_gradient(128, 256, 2, step)})
        codes += [st.code for st in comp.last_stats]
    return codes


def test_the_default_goes_lowrank_under_a_linear_optimizer_only() -> None:
    assert TailConfig().lowrank == "auto"
    # 40 steps: past the warm-up and the first re-decision (step 20 here).
    sgd = TailCompressor(TailConfig(seed=1))
    sgd.set_linear_optimizer(True)  # what HookState.set_optimizer(SGD) says at the first step
    assert "lowrank-r2" in _codes_over(sgd, 40)
    # Adam, or a trainer that never says: every step quantized, bit for bit as "off" would send.
    untold, off = TailCompressor(TailConfig(seed=1)), TailCompressor(TailConfig(seed=1, lowrank="off"))
    for step in range(40):
        g = _low_rank_gradient(128, 256, 2, step)
        assert untold.compress({"w": g}) == off.compress({"w": g}), step
    assert untold.lowrank is not None and untold.lowrank.ranks() == {}
    # "on": low-rank whatever the optimizer, as "auto" was before it followed it.
    assert "lowrank-r2" in _codes_over(TailCompressor(TailConfig(seed=1, lowrank="on")), 40)


def test_off_or_no_error_feedback_never_builds_a_chooser() -> None:
    for config in (TailConfig(seed=1, lowrank="off"), TailConfig(seed=1, error_feedback=False)):
        comp = TailCompressor(config)
        for step in range(6):
            comp.compress({"w": _low_rank_gradient(128, 256, 2, step)})
            assert all(not st.code.startswith("lowrank") for st in comp.last_stats), (config, step)
        assert comp.lowrank is None


def test_sharded_compression_stays_quantized() -> None:
    comp = _tail()
    for step in range(8):
        comp.compress({"w": _low_rank_gradient(128, 256, 2, step, noise=0.01)})
    assert comp.lowrank is not None and comp.lowrank.rank_of("w") > 0
    g = _low_rank_gradient(128, 256, 2, 9, noise=0.01)
    payloads = comp.compress_shards({"w": g}, [{"w": slice(0, 16384)}, {"w": slice(16384, 32768)}])
    assert all(isinstance(rec, QuantRecord) for p in payloads for rec in decode_payload(p))


def test_an_exactly_low_rank_layer_stays_quantized_when_its_factors_would_not_save_bytes() -> None:
    # A 32 x 144 layer (conv2 of digits_cnn as a matrix) whose gradient has rank 12: rank 16
    # would hold it exactly, but 16 x (32 + 144) factor bytes are more than 80 % of its ~2 KB
    # quantized payload, and rank 8 leaves a third of it. The same gradient family at rank 2
    # is cheaper low-rank, and is sent so.
    rank12, rank2 = _tail(rounding="nearest"), _tail(rounding="nearest")  # the bytes it was sized on
    for step in range(16):
        rank12.compress({"w": _low_rank_gradient(32, 144, 12, step, noise=0.0)})
        rank2.compress({"w": _low_rank_gradient(32, 144, 2, step, noise=0.0)})
    assert rank12.lowrank is not None and rank2.lowrank is not None
    assert rank12.lowrank.rank_of("w") == 0
    assert not rank12.last_stats[0].code.startswith("lowrank")
    assert rank2.lowrank.rank_of("w") in (2, 4)


def _head_like_gradient(step: int, small_scale: float, shared: bool) -> torch.Tensor:
    """An LM output layer's shape of gradient: 16 frequent rows carrying a rank-2 signal, 112
    rare rows 1000x smaller. ``shared``: the rare rows lie in the same rank-2 subspace (the
    factors capture them too); else each pushes its own fixed direction, which no rank <= 16
    of this 128 x 256 matrix holds."""
    gen = torch.Generator().manual_seed(99)
    u, v = torch.randn(128, 2, generator=gen), torch.randn(256, 2, generator=gen)
    own = torch.randn(128, 256, generator=gen)
    step_gen = torch.Generator().manual_seed(step)
    coeff = 1.0 + 0.1 * torch.randn(2, generator=step_gen)
    g = (u * coeff) @ v.T + 0.01 * torch.randn(128, 256, generator=step_gen)
    if not shared:
        g[16:] = own[16:]
    g[16:] *= small_scale
    return g


def _sent_rank(comp: TailCompressor) -> int:
    code = comp.last_stats[0].code
    return int(code.removeprefix("lowrank-r")) if code.startswith("lowrank") else 0


@pytest.mark.parametrize("shared", [False, True])
def test_a_trial_refuses_lowrank_where_the_factors_would_lose_the_typical_row(shared: bool) -> None:
    comp = _tail()
    for step in range(40):
        comp.compress({"w": _head_like_gradient(step, 1e-3, shared=shared)})
        assert _sent_rank(comp) == 0
    # The big rows alone would pass (the layer's residual ratio is theirs), but the rare rows'
    # entries of P, 1000x smaller, fall below a step of its 8-bit grid (both cases) or outside
    # the rank's subspace (not shared): every trial fails.
    assert comp.lowrank is not None and comp.lowrank.rows_left_behind["w"] >= 2


def test_lowrank_keeps_a_layer_whose_small_rows_its_factors_hold() -> None:
    comp = _tail()
    for step in range(40):
        comp.compress({"w": _head_like_gradient(step, 0.05, shared=True)})
    # Rows 20x apart, in the factors' subspace and within their 8-bit range: every row is sent.
    # (At 1000x the rare rows' entries in P fall below half a step of its 8-bit grid, and are
    # left behind like rows outside the subspace: the case above, caught the same way.)
    assert comp.lowrank is not None and comp.lowrank.rank_of("w") > 0
    assert comp.lowrank.rows_left_behind == {}


def test_rows_lost_share_counts_rows_below_the_factor_grid() -> None:
    p = np.zeros((8, 2), np.float32)
    p[:2] = 1.0  # the bucket's max: its step is 1/127 at 8 bits
    # Below half a step, stochastic rounding's variance step^2 f (1 - f) exceeds the energy
    # (f step)^2: lost. Above it, kept.
    p[2:4] = 0.6 / 127  # kept: variance 0.24 step^2 against 0.36 step^2
    p[4] = 0.4 / 127  # lost: 0.24 against 0.16
    p[5] = 2e-4  # lost: 0.025 of a step
    p[6] = 0.25  # kept: 32 steps
    # Row 7 is zero: no gradient, nothing to lose.
    assert rows_lost_share(p, 8, 16) == 2 / 8
    assert rows_lost_share(p, 2, 16) == 5 / 8  # 2 bits: the step is the max, rows 2-6 below half of it
