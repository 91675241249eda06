"""Smoke run of the network benchmark over a real rate-limited veth link (2 steps, 2 methods)."""

import json
import os
from pathlib import Path

import pytest

from jobs import bench_network

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def test_bench_network_counts_the_bytes_the_link_really_carried(tmp_path: Path, capsys) -> None:
    out = tmp_path / "net.json"
    rc = bench_network.main(
        [
            "--links",
            "200",
            "--models",
            "char_transformer",
            "--methods",
            "none,tail",
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    none, tail = rows["none"], rows["tail"]
    assert none["link"] == "200Mbit" and none["speedup_vs_none"] == 1.0
    for r in (none, tail):
        # The interface's own counters carry at least what the transport says it sent
        # (plus TCP/IP headers and gloo's own control messages).
        assert r["bytes_per_step_interface"] >= 0.95 * r["bytes_per_step_transport"] > 0
    assert tail["bytes_per_step_transport"] < none["bytes_per_step_transport"] / 4
    assert "speedup" in capsys.readouterr().out
