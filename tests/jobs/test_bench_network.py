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


def test_bench_network_three_ranks_on_a_bridge_count_bytes_per_rank(tmp_path: Path) -> None:
    out = tmp_path / "net3.json"
    rc = bench_network.main(
        ["--world-size", "3", "--links", "200", "--models", "char_transformer",
         "--methods", "none,tail-sharded", "--steps", "2", "--warmup-steps", "1", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["world_size"] == 3
    rows = {r["method"]: r for r in data["results"]}
    for r in rows.values():
        assert r["world_size"] == 3
        # Each rank's own interface carried at least what its transport sent.
        assert r["bytes_per_step_interface"] >= 0.95 * r["bytes_per_step_transport"] > 0
        assert r["bytes_per_step_interface_max"] >= r["bytes_per_step_interface"]
    sharded = rows["tail-sharded"]
    # Two stages of (W-1)/W of a payload each: 4/3 of a rank's own payload, plus framing.
    assert sharded["bytes_per_step_transport"] < 2 * sharded["encoded_bytes_per_step"]
