"""The network lab makes a real rate-limited link and always removes it."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jobs.netlab import NetLab

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

SERVER = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5601)); s.listen(1); s.settimeout(20)
    c, _ = s.accept(); n = 0; t0 = None
    while True:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.perf_counter(); n += len(b)
    print(n, time.perf_counter() - t0)
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    for _ in range(100):
        try:
            s = socket.create_connection((sys.argv[1], 5601), timeout=5); break
        except OSError: time.sleep(0.05)
    buf = b"x" * (1 << 20)
    for _ in range(int(sys.argv[2])): s.sendall(buf)
    s.close()
""")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_rate_limited_link_is_really_slow_and_is_removed(tmp_path: Path) -> None:
    with NetLab(rate_mbit=40, tag="t1") as lab:
        a, b = lab.hosts
        assert a.netns in _namespaces() and b.netns in _namespaces()
        server = subprocess.Popen(
            [*b.exec_prefix(), sys.executable, "-c", SERVER, b.address], stdout=subprocess.PIPE, text=True
        )
        subprocess.run(
            [*a.exec_prefix(), sys.executable, "-c", CLIENT, b.address, "8"], check=True, timeout=60
        )
        out, _ = server.communicate(timeout=60)
        nbytes, seconds = (float(v) for v in out.split())
        tx, _rx = a.tx_rx_bytes()
        mbit_s = nbytes * 8 / 1e6 / seconds
        assert nbytes == 8 * (1 << 20)
        assert 20 < mbit_s < 44, f"measured {mbit_s:.1f} Mbit/s through a 40 Mbit/s link"
        assert tx >= nbytes  # the interface's own counters saw every byte
    assert "tailnet-t1" not in _namespaces()


def test_lab_is_removed_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), NetLab(rate_mbit=None, tag="t2"):
        assert "tailnet-t2-a" in _namespaces()
        raise RuntimeError("boom")
    assert "tailnet-t2" not in _namespaces()


def test_lab_is_removed_on_sigterm(tmp_path: Path) -> None:
    script = (
        "import time; from jobs.netlab import NetLab\nwith NetLab(rate_mbit=100, tag='t3'):\n"
        "    print('up', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    assert "tailnet-t3-a" in _namespaces()
    proc.terminate()
    proc.wait(timeout=20)
    time.sleep(0.2)
    assert "tailnet-t3" not in _namespaces()


def _lab_links_in_root(tag: str) -> list[str]:
    """Links of the root namespace named like this lab's (others may make links meanwhile)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if tag in line.split(":")[1]]


def test_bridge_of_three_hosts_limits_each_host_and_leaves_nothing_behind() -> None:
    """Three hosts on a bridge in a namespace of its own: a -> c crosses two shaped veths (a's
    upload, c's download); nothing is made in, or left in, the root namespace."""
    with NetLab(rate_mbit=40, tag="t4", hosts=3) as lab:
        a, b, c = lab.hosts
        assert lab.switch is not None and lab.switch.netns in _namespaces()
        assert not _lab_links_in_root("t4")  # every veth end lives in a lab namespace
        server = subprocess.Popen(
            [*c.exec_prefix(), sys.executable, "-c", SERVER, c.address], stdout=subprocess.PIPE, text=True
        )
        subprocess.run(
            [*a.exec_prefix(), sys.executable, "-c", CLIENT, c.address, "6"], check=True, timeout=60
        )
        out, _ = server.communicate(timeout=60)
        nbytes, seconds = (float(v) for v in out.split())
        mbit_s = nbytes * 8 / 1e6 / seconds
        assert nbytes == 6 * (1 << 20)
        assert 20 < mbit_s < 44, f"measured {mbit_s:.1f} Mbit/s through 40 Mbit/s links"
        assert a.tx_rx_bytes()[0] >= nbytes and c.tx_rx_bytes()[1] >= nbytes
        assert b.tx_rx_bytes()[1] < nbytes / 10  # the bridge forwarded a -> c, not to b
    assert "tailnet-t4" not in _namespaces()
    assert not _lab_links_in_root("t4")
