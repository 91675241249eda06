"""The codec's bytes do not move: a seeded corpus encodes to the digest main's codec gave.

EXPECTED_DIGEST was generated from main's codec (commit 2e49cdf, before the codec was split
into layers for issue 11) by this very test; any change to a code's choice, a table, a stream
or the framing changes it. If the wire format changes on purpose, the version byte changes
with it and so does this digest.

Version 4 (16-bit scales, a header flag) changed it from 05d965231f37... to the one below: the
corpus's random scales are off the 16-bit grid, so its payloads keep float32 scales, and with
``wire.VERSION`` patched back to 3 the new encoder gives the old digest exactly (checked when
the version changed): the version byte is the only byte that moved.

Front-coded names (the NAMES_SHARED flag, issue 15) changed it again: most of the corpus's
payloads have names with shared prefixes ("dense-2", "dense-big-odd-2"). With every shared
prefix taken as empty the encoder writes the plain names and gives the digest before
(DIGEST_PLAIN_NAMES, checked below): the names and the flag are the only bytes that moved.
"""

from __future__ import annotations

import numpy as np
import pytest

from tail_ray.compression import wire
from tail_ray.compression.code_table import candidate_codes, encode_levels
from tail_ray.compression.records import LayerRecord, QuantRecord, RawRecord, SparseRecord
from tail_ray.compression.wire import decode_payload, encode_payload
from tests.compression.codec_corpus import (
    Costs,
    QuantSpec,
    RawSpec,
    SparseSpec,
    Spec,
    corpus,
    corpus_digest,
    payload_groups,
)

EXPECTED_DIGEST = "26ccae8e8f7bb8eca966469e447c02958e042b8ad5451e4956b63fac3922ce96"
DIGEST_PLAIN_NAMES = "d83cdd090bb0799167e17409272ccf981bee9e6d77e12952657098295b03b6a3"


def _record(spec: Spec) -> LayerRecord:
    if isinstance(spec, QuantSpec):
        return QuantRecord(spec.name, spec.bits, spec.bucket_size, spec.scales, spec.levels)
    if isinstance(spec, RawSpec):
        return RawRecord(spec.name, spec.values, fp16=spec.values.dtype == np.float16)
    return SparseRecord(spec.name, spec.numel, spec.indices, spec.values)


def _encode_group(group: list[Spec]) -> tuple[bytes, list[Costs]]:
    payload, costs = encode_payload([_record(s) for s in group])
    return payload, [Costs(c.name, c.encoded_bytes, c.code, c.nnz) for c in costs]


def _encode_forced(spec: QuantSpec) -> list[tuple[int, int, bytes]]:
    out = []
    for code in candidate_codes(spec.bits, spec.levels.size):
        got, nnz, body = encode_levels(spec.levels, spec.bits, force=code)
        out.append((int(got), nnz, body))
    return out


def test_corpus_encodes_to_the_bytes_main_gave() -> None:
    assert corpus_digest(_encode_group, _encode_forced) == EXPECTED_DIGEST


def test_with_names_plain_the_corpus_encodes_to_the_bytes_before_names_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No shared prefix: the front-coded form is never smaller, so every payload keeps plain names.
    monkeypatch.setattr(wire, "_shared_prefix", lambda a, b: 0)
    # Uncached, so the names are coded again under the patch, not looked up.
    monkeypatch.setattr(wire, "_name_fields", wire._name_fields.__wrapped__)
    assert corpus_digest(_encode_group, _encode_forced) == DIGEST_PLAIN_NAMES


def test_corpus_decodes_to_what_was_encoded() -> None:
    for group in payload_groups(corpus()):
        payload, _ = encode_payload([_record(s) for s in group])
        for spec, rec in zip(group, decode_payload(payload), strict=True):
            assert rec.name == spec.name
            if isinstance(spec, QuantSpec):
                assert isinstance(rec, QuantRecord)
                assert np.array_equal(rec.levels, spec.levels)
                assert rec.scales.tobytes() == spec.scales.tobytes()
            elif isinstance(spec, RawSpec):
                assert isinstance(rec, RawRecord)
                want = spec.values.astype(np.float32)
                assert rec.values.tobytes() == want.tobytes()
            else:
                assert isinstance(spec, SparseSpec) and isinstance(rec, SparseRecord)
                assert np.array_equal(rec.indices, spec.indices)
                assert rec.values.tobytes() == spec.values.tobytes()
