"""A real bandwidth-limited network on this machine: network namespaces joined by veth links.

Two hosts: one veth pair between them. More hosts (``hosts=N``): each host's veth goes to a
bridge in a namespace of its own (the "switch"), never in the root namespace, so nothing of
the machine's own network changes. Each end of every veth gets a `tc` token-bucket rate limit
(``tbf``) on its egress, so every host's upload AND download are as slow as asked, and
traffic between namespaces crosses real kernel links.
Addresses come from 198.18.0.0/15, the range RFC 2544 reserves for network benchmarks, so
they can never reach a real host; nothing is routed out of the namespaces.

The lab removes everything it made on exit, on an exception, and on SIGINT/SIGTERM.
`netem` (added delay) is not available on every kernel (it is not on our CI machines); the
lab then runs rate-limited only and says so in ``NetLab.delay_ms``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

logger = logging.getLogger(__name__)

SUBNET_PREFIX = "198.18.0"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class NetLabError(RuntimeError):
    """The namespaces could not be made (not root, no iproute2, no veth): never fake a link."""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetLabError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    address: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def tx_rx_bytes(self) -> tuple[int, int]:
        """The interface's own byte counters, read inside its namespace."""
        out = []
        for counter in ("tx_bytes", "rx_bytes"):
            proc = _run(*self.exec_prefix(), "cat", f"/sys/class/net/{self.ifname}/statistics/{counter}")
            out.append(int(proc.stdout.strip()))
        return out[0], out[1]


class NetLab:
    """Context manager: ``with NetLab(rate_mbit=1000) as lab: lab.hosts[0] ...``.

    ``rate_mbit=None`` leaves the link unlimited (veth speed: memory bandwidth).
    """

    def __init__(
        self,
        rate_mbit: float | None,
        *,
        delay_ms: float = 0.0,
        tag: str | None = None,
        hosts: int = 2,
        loopback: bool = False,
    ) -> None:
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0 or None, got {rate_mbit}")
        if not 2 <= hosts <= len(_LETTERS):
            raise ValueError(f"hosts must be in 2..{len(_LETTERS)}, got {hosts}")
        if loopback and rate_mbit is not None:
            raise ValueError("a loopback lab has no rate limit")
        self.loopback = loopback
        self.rate_mbit = rate_mbit
        self.requested_delay_ms = delay_ms
        self.delay_ms = 0.0
        tag = tag or f"{os.getpid()}"
        self.hosts = tuple(
            Host(f"tailnet-{tag}-{c}", f"tl{c}{tag}"[:15], f"{SUBNET_PREFIX}.{i + 1}")
            for i, c in enumerate(_LETTERS[:hosts])
        )
        if loopback:
            # Every "host" is the same fresh namespace, talking over its own loopback: its
            # counters see only this lab's traffic (each byte once: lo's tx == rx).
            self.hosts = tuple(Host(f"tailnet-{tag}-lo", "lo", "127.0.0.1") for _ in range(hosts))
        # The switch: a namespace holding the bridge and the hosts' peer ends (3+ hosts).
        self.switch = None if hosts == 2 or loopback else Host(f"tailnet-{tag}-sw", f"tlbr{tag}"[:15], "")
        self._tag = tag
        self._made: list[str] = []
        self._old_handlers: dict[int, object] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> NetLab:
        if os.geteuid() != 0:
            raise NetLabError("network namespaces need root (run as root, or use the loopback numbers)")
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        # Deleting a namespace deletes the veth end inside it, and with it the peer.
        for netns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
        self._made.clear()
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            # Turn SIGTERM into an exception so `with` blocks unwind and clean up.
            raise KeyboardInterrupt(f"signal {signum}")

        for signum in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[signum] = signal.signal(signum, on_signal)

    def _create(self) -> None:
        if self.loopback:
            host = self.hosts[0]
            if Path(f"/run/netns/{host.netns}").exists():
                raise NetLabError(f"namespace {host.netns} already exists (a lab of this pid still running?)")
            _run("ip", "netns", "add", host.netns)
            self._made.append(host.netns)
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            logger.info("netlab up: %d hosts on the loopback of %s", len(self.hosts), host.netns)
            return
        spaces = [*self.hosts, *([self.switch] if self.switch is not None else [])]
        for host in spaces:
            if Path(f"/run/netns/{host.netns}").exists():
                raise NetLabError(f"namespace {host.netns} already exists (a lab of this pid still running?)")
            _run("ip", "netns", "add", host.netns)
            self._made.append(host.netns)
        if self.switch is None:
            a, b = self.hosts
            _run("ip", "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        else:
            sw = self.switch
            _run("ip", "-n", sw.netns, "link", "add", sw.ifname, "type", "bridge")
            _run("ip", "-n", sw.netns, "link", "set", sw.ifname, "up")
            for host in self.hosts:
                port = self.port_of(host)
                # Made inside the namespaces: no end ever appears in the root namespace.
                _run(
                    "ip", "-n", host.netns, "link", "add", host.ifname,
                    "type", "veth", "peer", "name", port.ifname, "netns", sw.netns,
                )  # fmt: skip
                _run("ip", "-n", sw.netns, "link", "set", port.ifname, "master", sw.ifname)
                _run("ip", "-n", sw.netns, "link", "set", port.ifname, "up")
                if self.rate_mbit is not None:
                    self._shape(port)  # what the host downloads
        for host in self.hosts:
            if self.switch is None:
                _run("ip", "link", "set", host.ifname, "netns", host.netns)
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _run("ip", "-n", host.netns, "link", "set", host.ifname, "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            if self.rate_mbit is not None:
                self._shape(host)  # what the host uploads
        logger.info(
            "netlab up: %s, rate %s, delay %.1f ms",
            ", ".join(f"{h.netns} ({h.address})" for h in self.hosts)
            + ("" if self.switch is None else f" on bridge {self.switch.netns}"),
            "unlimited" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s",
            self.delay_ms,
        )

    def port_of(self, host: Host) -> Host:
        """The switch-side end of ``host``'s veth (3+ hosts)."""
        assert self.switch is not None
        letter = host.netns.rsplit("-", 1)[1]
        return Host(self.switch.netns, f"tp{letter}{self._tag}"[:15], "")

    def _shape(self, host: Host) -> None:
        rate = f"{self.rate_mbit:g}mbit"
        if self.requested_delay_ms > 0:
            netem = subprocess.run(
                [
                    "tc",
                    "-n",
                    host.netns,
                    "qdisc",
                    "add",
                    "dev",
                    host.ifname,
                    "root",
                    "netem",
                    "delay",
                    f"{self.requested_delay_ms:g}ms",
                    "rate",
                    rate,
                    "limit",
                    "100000",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if netem.returncode == 0:
                self.delay_ms = self.requested_delay_ms
                return
            logger.warning(
                "netem unavailable on this kernel (%s): rate limit only, no added delay", netem.stderr.strip()
            )
        # Burst of ~1 ms of traffic (at least 64 KiB) keeps tbf accurate at GSO packet sizes.
        burst_bytes = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 1000))
        _run(
            "tc",
            "-n",
            host.netns,
            "qdisc",
            "add",
            "dev",
            host.ifname,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            str(burst_bytes),
            "latency",
            "200ms",
        )
