"""What the service shows to whom: the Host allow-list, and whether a request came in beyond
loopback.

Host allow-list: a web page the user opens can make their browser send requests to
``http://127.0.0.1:8000`` under a name the page controls (DNS rebinding: the name first
resolves to the page's server, then to 127.0.0.1), and then read the answers as same-origin.
The browser still sends the page's own name in ``Host``, so answering only the names the
service is reached by (loopback names by default, ``TAIL_RAY_ALLOWED_HOSTS`` for a deployment)
closes that door. Starlette's TrustedHostMiddleware splits ``Host`` on the first colon, which
mangles IPv6 literals (``[::1]:8000``); this one parses them. The probes answer any Host:
kubelet sends the pod IP.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from service.errors import error_body
from service.limits import declares_body, with_connection_close

PROBE_PATHS = frozenset({"/healthz", "/readyz"})


def host_name(header: str) -> str:
    """The name in a Host header, lower case, without port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, _ = header.partition(":")
    return name.rstrip(".")


def is_loopback(host: str) -> bool:
    """True for a loopback IP (v4, v6, v4-mapped v6). Names other than IPs (a Unix socket's
    path, the test client's "testserver") are not network addresses: True."""
    try:
        addr = ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return True
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def arrived_beyond_loopback(scope: Scope) -> bool:
    """True when the connection reached us on an address other than loopback: the service is
    bound beyond loopback and this client may be anyone on the network."""
    server = scope.get("server")
    return server is not None and not is_loopback(str(server[0]))


class HostAllowList:
    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allow_any = "*" in allowed_hosts
        self.allowed = frozenset(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allow_any or scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        raw = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        name = host_name(raw)
        if name in self.allowed:
            await self.app(scope, receive, send)
            return
        detail = f"Host {raw[:200]!r} is not one this service answers to; list it in TAIL_RAY_ALLOWED_HOSTS"
        data = json.dumps(error_body("host_not_allowed", detail)).encode()
        start: dict[str, Any] = {
            "type": "http.response.start",
            "status": 400,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
        await send(with_connection_close(start) if declares_body(scope) else start)
        await send({"type": "http.response.body", "body": data})
