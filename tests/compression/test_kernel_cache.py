"""The shared kernel cache (tail_ray/kernel_cache.py) and the warmup that fills it: a kernel
compiled by one process is loaded by the next, also from a copy of the package elsewhere (as
Ray unpacks a job's working_dir), and never when any source file of the package changed."""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core.registry import CPUDispatcher

import tail_ray
from tail_ray import kernel_cache

# A child process calls one small kernel and reports where numba looked and what it found.
_PROBE = """
import json, numpy as np, tail_ray
from tail_ray.compression.fixedsum import sum_squares
sum_squares(np.ones(10, np.float32))
stats = sum_squares.stats
print(json.dumps({"package": tail_ray.__file__, "cache_path": stats.cache_path,
                  "hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
"""


def _probe(cache: Path, pythonpath: Path | None = None) -> dict[str, object]:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300, cwd=cache.parent
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_kernel_compiled_once_is_loaded_by_every_later_process_wherever_the_package_lives(tmp_path):
    cache = tmp_path / "numba"
    first = _probe(cache)
    assert first["misses"] == 1 and first["hits"] == 0  # compiled, and written to the cache
    assert str(first["cache_path"]).startswith(str(cache)) and "tail_ray" in str(first["cache_path"])
    assert _probe(cache)["hits"] == 1  # a second process loads it

    # A copy of the package at another path, as Ray unpacks a job's working_dir.
    copy = tmp_path / "working_dir"
    shutil.copytree(
        Path(tail_ray.__file__).parent, copy / "tail_ray", ignore=shutil.ignore_patterns("__pycache__")
    )
    moved = _probe(cache, pythonpath=copy)
    assert moved["package"] == str(copy / "tail_ray" / "__init__.py")
    assert moved["hits"] == 1 and moved["misses"] == 0

    # Any change anywhere in the package (here: a module the kernel does not even import) makes
    # the cached kernels stale: numba alone would only watch the kernel's own file.
    with open(copy / "tail_ray" / "errors.py", "a") as f:
        f.write("\n# changed\n")
    assert _probe(cache, pythonpath=copy)["misses"] == 1


def test_the_cache_directory_follows_numba_cache_dir_else_the_home(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "x"))
    assert kernel_cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kernel_cache.cache_dir() == tmp_path / ".tail_ray" / "numba-cache"


def test_prune_keeps_this_version_and_the_most_recent_others(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    current = kernel_cache.version_dir()
    current.mkdir(parents=True)
    others = [tmp_path / f"tail_ray-{i:016x}" for i in range(5)]
    for age, d in enumerate(others):
        d.mkdir()
        os.utime(d, (1e9 - age, 1e9 - age))  # others[0] is the most recent
    (tmp_path / "unrelated").mkdir()
    removed = kernel_cache.prune_versions(keep=3)
    assert sorted(removed) == sorted(others[2:])
    assert (
        current.is_dir() and others[0].is_dir() and others[1].is_dir() and (tmp_path / "unrelated").is_dir()
    )


def _kernels() -> list[tuple[str, CPUDispatcher]]:
    """Every numba kernel of tail_ray that is compiled on its own (not inlined into others)."""
    out = []
    for info in pkgutil.walk_packages(tail_ray.__path__, "tail_ray."):
        if info.name.startswith(("tail_ray.runner", "tail_ray.metrics", "tail_ray.collective")):
            continue  # Ray / torch.distributed side: no kernels there
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if e.name == "triton":  # the gpu extra's Triton modules hold no numba kernels
                continue
            raise
        for name, obj in vars(module).items():
            own = isinstance(obj, CPUDispatcher) and obj.__module__ == info.name
            if own and obj.targetoptions.get("inline") != "always":
                out.append((f"{info.name}.{name}", obj))
    return out


# In a child: a cold warmup (every kernel then has a compiled signature: numba compiles the
# callees of a kernel too), or a codec workload against the cache the warmup filled.
_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from test_kernel_cache import _kernels
if sys.argv[1] == "warmup":
    from tail_ray.warmup import warmup
    warmup(max_world=4)
else:
    from isa_digest import digests
    digests()  # every compressor and code, error feedback, decoding, means of 2..4 ranks
kernels = _kernels()
print(json.dumps({{
    "never_compiled": [n for n, d in kernels if not d.signatures],
    "misses": sum(sum(d.stats.cache_misses.values()) for _, d in kernels),
    "hits": sum(sum(d.stats.cache_hits.values()) for _, d in kernels),
}}))
"""


def _child(what: str, cache: Path) -> dict[str, object]:
    code = _CHILD.format(tests=str(Path(__file__).parent))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    out = subprocess.run(
        [sys.executable, "-c", code, what], env=env, capture_output=True, text=True, timeout=540
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_after_a_cold_warmup_the_codec_runs_without_compiling_anything(tmp_path):
    """A cold warmup compiles every kernel (about a minute of CPU on 2 cores); a later process
    running every compressor, code and mean (the cross-CPU digest's workload) then compiles
    nothing: every kernel comes from the cache."""
    cache = tmp_path / "numba"
    cold = _child("warmup", cache)
    assert cold["never_compiled"] == [], f"warmup never compiled: {cold['never_compiled']}"
    assert cold["misses"] > 20
    warm = _child("workload", cache)
    assert warm["misses"] == 0 and warm["hits"] > 20, warm


def test_the_cli_warmup_reports_its_stages(capsys):
    from service.cli import main

    assert main(["warmup", "--max-world", "2"]) == 0
    printed = capsys.readouterr().out
    assert "[1/3] compressors and codes" in printed and "[3/3]" in printed
    assert "kernels ready in" in printed and str(kernel_cache.cache_dir()) in printed
    assert main(["warmup", "--max-world", "0"]) == 1
    assert "--max-world must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [0, -1])
def test_warmup_rejects_a_world_below_one(bad):
    from tail_ray.warmup import warmup

    with pytest.raises(ValueError, match="max_world"):
        warmup(max_world=bad)
