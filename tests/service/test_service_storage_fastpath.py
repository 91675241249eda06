"""The ingest fast path (`_RowMaker`) gives exactly the rows the careful field-by-field
`_coerce` gives, on ordinary records and on every kind of odd value that must leave it."""

from __future__ import annotations

import math

import pytest
from service_support import step_records

from service.storage import _LAYER_ROW, _STEP_ROW, LAYER_FIELDS, STEP_FIELDS, _coerce


def _same(a: object, b: object) -> bool:
    return all(
        (x is None and y is None) or (type(x) is type(y) and x == y) for x, y in zip(a, b, strict=True)
    )


def test_fast_rows_equal_careful_rows_on_ordinary_records() -> None:
    for rec in step_records("job", step=3, ranks=2):
        fields, maker = (LAYER_FIELDS, _LAYER_ROW) if rec["type"] == "layer" else (STEP_FIELDS, _STEP_ROW)
        assert _same(maker(rec), _coerce(rec, fields))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ratio", math.nan), ("ratio", math.inf), ("ratio", -math.inf), ("ratio", 1e308),
        ("density", 1), ("bits", True), ("bits", 3.0), ("bits", "4"), ("numel", 2**70),
        ("layer", 7), ("rel_error", "0.5"),
    ],
)  # fmt: skip
def test_odd_values_take_the_careful_path(field: str, value: object) -> None:
    rec = next(r for r in step_records("job", step=1, ranks=1) if r["type"] == "layer")
    rec = (
        {**rec, field: value, "density": 1e308}
        if field == "ratio" and value == 1e308
        else {**rec, field: value}
    )
    try:
        expected = _coerce(rec, LAYER_FIELDS)
    except (TypeError, ValueError):
        with pytest.raises((TypeError, ValueError)):
            _LAYER_ROW(rec)
        return
    assert _same(_LAYER_ROW(rec), expected)
