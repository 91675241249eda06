"""Regenerate the KubeRay CRD schemas kept here as test data, from a git clone of KubeRay.

    python tests/deploy/kuberay_crds/extract.py /path/to/kuberay [--tags v1.6.0 v1.6.1 ...]

For each tag it reads ``ray-operator/config/crd/bases/ray.io_{rayclusters,rayjobs}.yaml`` with
``git show TAG:PATH`` (the same files the Helm chart installs from ``helm-chart/kuberay-operator/
crds/``), keeps the served ``v1`` version's ``openAPIV3Schema`` without its ``description``
fields (documentation only: they never change what validates), and writes it as canonical JSON,
gzipped with a fixed mtime so a rerun on the same input produces the same bytes. Tags whose schema
is byte-identical share one file. ``index.json`` records, per tag, the commit, the file and the
sha256 of the CRD YAML it came from.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CRD_PATH = "ray-operator/config/crd/bases/ray.io_{plural}.yaml"
KINDS = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}
# The KubeRay releases tail-ray supports (deploy/README.md), and the release line just below them,
# kept to show that the range's lower bound is real (it rejects authOptions.secretName).
SUPPORTED = ("v1.6.0", "v1.6.1", "v1.6.2", "v1.7.0")
BELOW_RANGE = ("v1.5.1", "v1.5.2")


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def _strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        # A property may itself be called "description"; only drop the keyword, i.e. a string.
        return {
            k: _strip_descriptions(v)
            for k, v in node.items()
            if not (k == "description" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [_strip_descriptions(v) for v in node]
    return node


def v1_schema(crd_yaml: bytes) -> dict[str, Any]:
    crd = yaml.safe_load(crd_yaml)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"], "ray.io/v1 must be the served storage version"
    return _strip_descriptions(version["schema"]["openAPIV3Schema"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kuberay", type=Path, help="a git clone of github.com/ray-project/kuberay")
    parser.add_argument("--tags", nargs="*", default=[*SUPPORTED, *BELOW_RANGE])
    args = parser.parse_args()

    index: dict[str, Any] = {
        "source": "https://github.com/ray-project/kuberay",
        "path": CRD_PATH,
        "kept": "spec.versions[name=v1].schema.openAPIV3Schema, description fields removed",
        "supported": [t for t in args.tags if t in SUPPORTED],
        "below_range": [t for t in args.tags if t in BELOW_RANGE],
        "versions": {},
    }
    written: dict[str, str] = {}  # content sha256 -> file name
    for tag in args.tags:
        commit = _git(args.kuberay, "rev-parse", f"{tag}^{{commit}}").decode().strip()
        entry: dict[str, Any] = {"commit": commit}
        for kind, plural in KINDS.items():
            crd_yaml = _git(args.kuberay, "show", f"{tag}:{CRD_PATH.format(plural=plural)}")
            text = json.dumps(v1_schema(crd_yaml), sort_keys=True, separators=(",", ":"))
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest not in written:
                written[digest] = f"{plural}-{tag}.json.gz"
                with gzip.GzipFile(HERE / written[digest], "wb", compresslevel=9, mtime=0) as out:
                    out.write(text.encode())
            entry[kind] = {"file": written[digest], "crd_yaml_sha256": hashlib.sha256(crd_yaml).hexdigest()}
        index["versions"][tag] = entry
    (HERE / "index.json").write_text(json.dumps(index, indent=2) + "\n")


if __name__ == "__main__":
    main()
