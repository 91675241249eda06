"""Every per-layer figure (bits, density, raw and encoded bytes, ratio, code) right for every
code the wire has: raw, bit-pack, rANS, pair rANS, sparse rANS and top-k's sparse positions.

The dashboard once showed a density of -25,165,823.6 for a sparse-coded ``fc1.weight`` of a
digits job: one bucket of subnormal gradients made the quantizer's L / s overflow, and its
non-zero count came out near -2^31 per element. Those layers are in here too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tail_ray.compression import make_compressor
from tail_ray.compression.grid import levels_max
from tail_ray.compression.records import LayerRecord, QuantRecord, RawRecord, SparseRecord
from tail_ray.compression.stats import LayerStats
from tail_ray.compression.wire import decode_payload, encode_payload

N = 20_000


def sparse_with_a_subnormal_bucket(rng: np.random.Generator, n: int = N) -> np.ndarray:
    """Mostly zeros (dead units) and one bucket of subnormal values: the digits fc1.weight case."""
    x = np.zeros(n, np.float32)
    x[rng.choice(n, n // 200, replace=False)] = rng.standard_normal(n // 200)
    x[:512] = rng.standard_normal(512).astype(np.float32) * np.float32(1e-40)
    return x


# (compressor, its settings, layers: name -> (gradient maker, the code it must pick))
CASES = [
    ("tail", {"candidate_bits": (4,), "small_layer_bits": 8}, {
        "bias": (lambda r: r.standard_normal(100), "bitpack"),  # small, at 8 bits: flat levels
        "pairs": (lambda r: r.standard_normal(N), "rans-pairs"),
        "fc1.weight": (sparse_with_a_subnormal_bucket, "sparse-rans"),
    }),
    ("tail", {"candidate_bits": (8,)}, {
        "rans": (lambda r: r.standard_normal(N), "rans"),
        "bitpack": (lambda r: r.uniform(-1, 1, 5_000), "bitpack"),  # flat levels: nothing for rANS to win
    }),
    ("tail", {"small_layer_bits": 32}, {"bias": (lambda r: r.standard_normal(100), "raw")}),
    ("tail", {}, {"norm.bias": (lambda r: r.standard_normal(100), "raw")}),  # the default: float16
    ("topk", {"density": 0.05}, {"topk": (lambda r: r.standard_normal(N), "sparse-pos")}),
    ("none", {}, {"none": (lambda r: r.standard_normal(N), "raw")}),
]  # fmt: skip


def layers_per_code(seed: int) -> list[tuple[str, LayerStats, LayerRecord, list[LayerStats], bytes]]:
    """(expected code, stats, the record the payload decodes to, all stats of that payload, payload)
    for one layer coded each way, made by the real compressors."""
    rng = np.random.default_rng(seed)
    out = []
    for method, settings, layers in CASES:
        if method == "tail":
            settings = {**settings, "seed": seed}
        comp = make_compressor(method, **settings)
        grads = {name: torch.from_numpy(make(rng).astype(np.float32)) for name, (make, _) in layers.items()}
        payload = comp.compress(grads)
        stats = list(comp.last_stats)
        records = decode_payload(payload)
        for (_, code), s, rec in zip(layers.values(), stats, records, strict=True):
            out.append((code, s, rec, stats, payload))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_every_code_reports_sane_figures(seed):
    frame = len(encode_payload([])[0])  # magic, version, layer count and the CRC trailer
    seen = set()
    for code, s, rec, payload_stats, payload in layers_per_code(seed):
        seen.add(code)
        assert s.code == code and s.layer == rec.name and s.numel == rec.numel, s
        assert 0.0 <= s.density <= 1.0, s
        assert s.raw_bytes == 4 * s.numel
        assert 0 < s.encoded_bytes <= s.raw_bytes + 64, s  # never more than raw plus a small frame
        assert s.ratio == pytest.approx(s.raw_bytes / s.encoded_bytes)
        # Every byte of a payload belongs to one layer or to the frame.
        assert sum(x.encoded_bytes for x in payload_stats) + frame == len(payload)
        if code == "raw":
            assert isinstance(rec, RawRecord) and s.density == 1.0
            assert (rec.fp16, s.bits) == ((True, 16) if rec.name == "norm.bias" else (False, 32))
        elif code == "sparse-pos":
            assert isinstance(rec, SparseRecord) and s.bits == 32
            assert s.density == rec.indices.size / s.numel == pytest.approx(0.05, abs=1 / s.numel)
        else:
            assert isinstance(rec, QuantRecord)
            assert 2 <= s.bits <= 8 and s.bits == rec.bits
            assert np.abs(rec.levels.astype(np.int16)).max() <= levels_max(rec.bits)
            assert s.density == np.count_nonzero(rec.levels) / s.numel
    assert seen == {"raw", "bitpack", "rans", "rans-pairs", "sparse-rans", "sparse-pos"}


def test_the_digits_case_a_sparse_layer_with_a_subnormal_bucket():
    rng = np.random.default_rng(3)
    comp = make_compressor("tail", seed=3)
    for _ in range(5):  # the subnormal bucket's residual carries over and stays tiny
        grad = sparse_with_a_subnormal_bucket(rng, 8_192)
        payload = comp.compress({"fc1.weight": torch.from_numpy(grad)})
        (s,) = comp.last_stats
        (rec,) = decode_payload(payload)
        assert isinstance(rec, QuantRecord)
        assert 0.0 <= s.density <= 1.0 and s.density == np.count_nonzero(rec.levels) / 8_192
