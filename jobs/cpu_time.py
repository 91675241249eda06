"""CPU time of processes and of the whole machine, for the benchmarks' reports (Linux)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int, *, include_root: bool = True) -> float:
    """CPU time of a process and its live descendants (a PostgreSQL server and its backends;
    the service's ingest process): a parent's own figure counts a child only once it has
    exited and been waited for."""
    import psutil  # Ray's own dependency

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)] if include_root else root.children(recursive=True):
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle (/proc/stat): on a 2-core machine a load generator
    and a database share the cores with the service, and a figure they limit shows up as a
    busy machine and an idle service."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
