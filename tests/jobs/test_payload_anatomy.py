"""The payload anatomy takes a real Tail payload apart, every byte counted once."""

import json

from jobs.payload_anatomy import main
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
            quantized = r["bits"] < 32
            # 4 bytes of scale per bucket of 512, only for quantized layers; tables only in rANS bodies.
            assert r["scales"] == (4 * -(-r["numel"] // 512) if quantized else 0)
            assert r["tables"] == 0 or r["code"].startswith(("rans", "sparse-rans"))
            assert r["frame"] > len(r["layer"])  # the name is in the layer's framing
    head_old, head_new = ({r["layer"]: r for r in res["layers"]}["fc2.weight"] for res in (old, new))
    assert head_old["bits"] == 32 and head_old["levels"] == 4 * 1280  # raw fp32 below 4096
    assert head_new["bits"] < 32 and head_new["total"] < head_old["total"] / 4
    assert new["payload_bytes"] < old["payload_bytes"]
