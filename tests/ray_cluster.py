"""A private, real Ray head node for one test module, started by the project's one launcher
(service/ray_head.py: `ray start --head --block` in its own session, explicit free ports, a
token made when none exists), with its own temp dir, torn down by its process group.

Why not ``ray.init()``: several engineers run clusters on this machine at once. A plain
``ray.init()`` may attach to someone else's ``ray start`` cluster; ``ray.cluster_utils`` writes
(and on shutdown deletes) the shared /tmp/ray address file; and the dashboard agent's default
port (52365) collides between clusters, which breaks the Jobs API. A ``--block`` head with
every port chosen by the launcher and ``--temp-dir`` of its own touches nobody else's cluster,
and stopping it is a signal to the process group we started. ``ray stop`` is never used: it
would kill every cluster on the machine.

Test clusters are not loopback-only (see service/ray_head.py): pytest joins them as a driver,
and the multi-node tests add nodes to them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from service.ray_head import LocalRayHead, short_temp_dir

STOP_GRACE_S = 5.0  # then SIGKILL: `ray start --block` can take 30 s to stop gracefully
OBJECT_STORE_BYTES = 200_000_000


@dataclass
class LocalRayCluster:
    num_cpus: int = 2
    include_dashboard: bool = True
    temp_dir: str = ""
    _head: LocalRayHead | None = field(default=None, repr=False)
    _log_path: str = ""

    @property
    def head(self) -> LocalRayHead:
        if self._head is None:
            raise RuntimeError("the cluster is not started")
        return self._head

    @property
    def address(self) -> str:
        return self.head.address

    @property
    def dashboard_url(self) -> str:
        return self.head.dashboard_url

    def start(self) -> LocalRayCluster:
        temp = short_temp_dir()
        self.temp_dir = str(temp)
        self._log_path = str(temp / "ray-start.log")
        self._head = LocalRayHead(
            num_cpus=self.num_cpus,
            log_path=Path(self._log_path),
            temp_dir=temp,
            include_dashboard=self.include_dashboard,
            object_store_bytes=OBJECT_STORE_BYTES,
            stop_grace_s=STOP_GRACE_S,
        )
        try:
            self._head.start()
        except BaseException as exc:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise RuntimeError(f"{exc}\n{self.log_tail()}") from exc
        return self

    def add_worker_node(self, num_cpus: int = 1) -> None:
        """Join one more node (same machine, own ports) to this cluster: what an elastic job
        sees when a machine joins. Stopped with the head."""
        n = len(self.head.node_processes)
        self.head.add_worker_node(num_cpus, log_path=Path(self.temp_dir) / f"ray-node-{n}.log")

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return Path(self._log_path).read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop every node we started (SIGTERM to each node's process group, a short grace,
        then SIGKILL), then remove the temp dir."""
        if self._head is not None:
            self._head.stop()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


@contextlib.contextmanager
def connected_cluster(num_cpus: int = 2, include_dashboard: bool = True):  # type: ignore[no-untyped-def]
    """Start a private head, connect this process to it, and tear both down afterwards."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "token"
    cluster = LocalRayCluster(num_cpus=num_cpus, include_dashboard=include_dashboard).start()
    old_address = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=True)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()
        if old_address is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = old_address
