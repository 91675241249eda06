"""A fixed, seeded corpus of layers for the codec's byte-identity check (plain numpy, no codec).

It holds several layers for every code the wire can send (bit-pack, rANS, pair rANS, sparse
rANS, sparse positions, raw f32 / f16) and the edge cases of test_wire.py, test_coding.py and
test_fast_stats.py: every bit-width 2..8, empty / one-level / all-zero layers, extremes,
uniform levels, layers on both sides of the exact-gap threshold and of the dense gap counter's
switch, clustered zeros (sparse wins), iid zeros (near-tie) and a layer whose sampled gaps
make sparse rANS look best until the exact count says otherwise. Raw values carry NaN
payloads, +-Inf, -0.0 and denormals.

It imports nothing from tail_ray, so the same corpus can be encoded by any version of the
codec: test_codec_corpus.py checks the digest that main's codec gave before the refactor of
issue 11 (the codec in layers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

SEED = 20261201
GAP_EXACT_NUMEL = 1 << 15  # the level coder counts gaps exactly up to here (pairs / statistics)


class QuantSpec(NamedTuple):
    name: str
    bits: int
    bucket_size: int
    scales: np.ndarray
    levels: np.ndarray


class RawSpec(NamedTuple):
    name: str
    values: np.ndarray  # float32 or float16


class SparseSpec(NamedTuple):
    name: str
    numel: int
    indices: np.ndarray
    values: np.ndarray


Spec = QuantSpec | RawSpec | SparseSpec


def _peaked(rng: np.random.Generator, n: int, half: int, spread: float) -> np.ndarray:
    return np.clip(np.round(rng.standard_normal(n) * max(spread * half, 0.6)), -half, half).astype(np.int8)


def _scattered(rng: np.random.Generator, n: int, half: int, density: float) -> np.ndarray:
    lv = rng.integers(-half, half + 1, size=n).astype(np.int8)
    lv[rng.random(n) >= density] = 0
    return lv


def _rows(rng: np.random.Generator, rows: int, cols: int, active: float, half: int) -> np.ndarray:
    out = np.zeros((rows, cols), np.int8)
    hot = rng.random(rows) < active
    out[hot] = _peaked(rng, int(hot.sum()) * cols, half, 0.3).reshape(-1, cols)
    return out.reshape(-1)


def _sample_fooler(rng: np.random.Generator, half: int) -> np.ndarray:
    """1M levels at 50% density whose sampled gap windows (4096 levels every 32768) are fully
    dense: the sample says gap coding is nearly free, the exact count says it is not."""
    n = 1 << 20
    lv = _scattered(rng, n, half, 0.5)
    for lo in range(0, n, 1 << 15):
        lv[lo : lo + 4096] = rng.choice([-1, 1], 4096)
    return lv


def level_cases(bits: int, rng: np.random.Generator) -> Iterator[tuple[str, np.ndarray]]:
    half = (1 << (bits - 1)) - 1
    big = GAP_EXACT_NUMEL + 12345  # sampled gap statistics, odd length
    yield "dense", _peaked(rng, 20_000, half, 0.25)
    yield "dense-big-odd", _peaked(rng, big, half, 0.25)
    yield "dense-big-even", _peaked(rng, big + 1, half, 0.1)
    yield "scattered", _scattered(rng, 50_000, half, 0.004)
    yield "scattered-big", _scattered(rng, 1 << 18, half, 0.01)
    yield "gap-switch-low", _scattered(rng, 1 << 17, half, 0.17)
    yield "gap-switch-high", _scattered(rng, 1 << 17, half, 0.19)
    yield "half-dense-big", _scattered(rng, big, half, 0.6)
    yield "rows", _rows(rng, 400, 100, 0.03, half)
    yield "rows-big", _rows(rng, 512, 512, 0.2, half)
    yield "zeros", np.zeros(10_000, np.int8)
    yield "zeros-big", np.zeros(1 << 20, np.int8)
    yield "one", np.array([half], np.int8)
    yield "two", np.array([-half, 0], np.int8)
    yield "empty", np.zeros(0, np.int8)
    yield "extremes", rng.choice([-half, half], 3000).astype(np.int8)
    yield "uniform", rng.integers(-half, half + 1, 5000).astype(np.int8)
    yield "tiny", np.clip(np.array([1, -1, 0], np.int8), -half, half)
    if bits in (3, 6):
        yield "sample-fooler", _sample_fooler(rng, half)


def quant_specs(rng: np.random.Generator) -> Iterator[QuantSpec]:
    for bits in range(2, 9):
        for case, levels in level_cases(bits, rng):
            bucket = int(rng.choice([64, 128, 512, 1 << 20]))
            scales = rng.random(-(-levels.size // bucket)).astype(np.float32)
            yield QuantSpec(f"{case}-{bits}", bits, bucket, scales, levels)


def raw_specs(rng: np.random.Generator) -> Iterator[RawSpec]:
    odd = np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x80000000, 1], np.uint32)
    yield RawSpec("raw-odd-floats", odd.view(np.float32))
    yield RawSpec("raw-normal", rng.standard_normal(4097).astype(np.float32))
    yield RawSpec("raw-empty", np.zeros(0, np.float32))
    yield RawSpec("raw-f16", np.array([1.0, np.inf, -2.5, 0.0, -0.0, 6e-8], np.float16))


def sparse_specs(rng: np.random.Generator) -> Iterator[SparseSpec]:
    for n, k in ((200_000, 2000), (1000, 11), (1 << 22, 300), (10, 10), (50, 0)):
        idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        vals = rng.standard_normal(k).astype(np.float32)
        yield SparseSpec(f"topk-{n}-{k}", n, idx, vals)
    far = np.array([0, 7, 8, 9, 1 << 20, (1 << 30) - 1], np.int64)  # long gaps: many slot ranges
    yield SparseSpec("topk-far", 1 << 30, far, np.ones(far.size, np.float32))


def corpus() -> list[Spec]:
    """Every layer of the corpus, in a fixed order (one seeded generator for all of it)."""
    rng = np.random.default_rng(SEED)
    return [*quant_specs(rng), *raw_specs(rng), *sparse_specs(rng)]


def payload_groups(specs: list[Spec]) -> list[list[Spec]]:
    """The corpus cut into payloads of a few layers each (mixed kinds), in order."""
    return [specs[i : i + 5] for i in range(0, len(specs), 5)]


class Costs(NamedTuple):
    name: str
    encoded_bytes: int
    code: str
    nnz: int


def corpus_digest(
    encode_group: Callable[[list[Spec]], tuple[bytes, list[Costs]]],
    encode_forced: Callable[[QuantSpec], list[tuple[int, int, bytes]]],
) -> str:
    """sha256 over every payload (with each layer's cost line) and, for every quantized layer,
    the body of every candidate code forced in turn (code id, nnz, body). The callables adapt
    one codec version's API: ``encode_group`` frames a list of specs into one payload,
    ``encode_forced`` returns (code, nnz, body) per candidate code, in candidate order."""
    h = hashlib.sha256()
    specs = corpus()
    for group in payload_groups(specs):
        payload, costs = encode_group(group)
        h.update(len(payload).to_bytes(8, "little") + payload)
        for c in costs:
            h.update(f"{c.name}|{c.encoded_bytes}|{c.code}|{c.nnz};".encode())
    for spec in specs:
        if isinstance(spec, QuantSpec):
            for code, nnz, body in encode_forced(spec):
                h.update(f"{spec.name}|{code}|{nnz}|{len(body)};".encode() + body)
    return h.hexdigest()
