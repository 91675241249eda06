"""The payload anatomy takes a real Tail payload apart, every byte counted once."""

import json

import numpy as np
import pytest

from jobs.payload_anatomy import context_bound_bytes, main
from tail_ray.compression.entropy import entropy_bound_bytes
from tail_ray.compression.wire import PAYLOAD_OVERHEAD_BYTES


def test_payload_anatomy_counts_every_byte_and_shows_a_quantized_head(tmp_path, capsys):
    out = tmp_path / "anatomy.json"
    args = ["--models", "digits_cnn", "--steps", "6", "--keep", "4", "--json", str(out)]
    assert main([*args, "--raw-below-numel", "4096", "--raw-below-numel", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "raw_below_numel=4096" in printed and "raw_below_numel=1024" in printed
    old, new = json.loads(out.read_text())
    for res in (old, new):
        parts = sum(r["frame"] + r["scales"] + r["tables"] + r["levels"] for r in res["layers"])
        assert parts + PAYLOAD_OVERHEAD_BYTES == res["payload_bytes"]
        for r in res["layers"]:
            quantized = r["bits"] <= 8  # 16: a small layer as float16, 32: raw fp32
            # 2 bytes of scale per bucket of 512 (Tail's scales go as u16), only for quantized
            # layers; tables only in rANS bodies.
            assert r["scales"] == (2 * -(-r["numel"] // 512) if quantized else 0)
            assert r["tables"] == 0 or r["code"].startswith(("rans", "sparse-rans"))
            assert r["frame"] > len(r["layer"])  # the name is in the layer's framing
            # The order-1 bound: below or at the order-0 one, and present for quantized layers.
            assert 0 <= r["h1_levels"] <= r["h0_levels"] and (r["h1_levels"] > 0) == (
                quantized and r["h0_levels"] > 0
            )
    head_old, head_new = ({r["layer"]: r for r in res["layers"]}["fc2.weight"] for res in (old, new))
    assert head_old["bits"] == 16 and head_old["levels"] == 2 * 1280  # float16 below 4096
    assert head_new["bits"] <= 8 and head_new["total"] < head_old["total"] / 2
    assert new["payload_bytes"] < old["payload_bytes"]


def test_context_bound_sees_row_structure_and_not_noise():
    """The order-1 bound is the order-0 one on independent levels and far below it where a
    level's magnitude follows its row (as an un-normalised row scale would make it)."""
    rng = np.random.default_rng(0)
    iid = rng.integers(-3, 4, size=64 * 128).astype(np.int8)
    h0 = entropy_bound_bytes(iid)
    assert context_bound_bytes(iid, 128) <= h0
    assert context_bound_bytes(iid, 128) > 0.99 * h0  # 9 contexts of ~900 levels: a small bias only
    # Rows alternate all-zero and +-3 of random sign: within a row the previous level says
    # which, so only the signs are left (1 bit per non-zero level, 1/3 of H0's 1.5 bits).
    rows = np.where((np.arange(64) % 2 == 0)[:, None], 0, 3 * rng.choice([-1, 1], size=(64, 128)))
    structured = rows.astype(np.int8).reshape(-1)
    # (Row 0 has no row up, and each row's first level sees the row before: a few % more.)
    assert context_bound_bytes(structured, 128) == pytest.approx(
        entropy_bound_bytes(structured) / 3, rel=0.05
    )
