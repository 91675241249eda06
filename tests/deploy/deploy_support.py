"""Shared readers for the deploy/ tests: manifests, Dockerfiles, pyproject, the service's names.

Everything is read from the files in the repository; nothing here knows the answers the tests
check, so a change to one file that the others do not follow makes a test fail.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
# What `kubectl apply -k` / `kubectl create -k` take (deploy/README.md): the long-lived cluster
# and control plane, and the one-shot jobs.
KUSTOMIZATIONS = (K8S, K8S / "jobs")
KUSTOMIZATION_FILE = "kustomization.yaml"

# The Kubernetes versions the manifests must validate against: the oldest we document support for
# in deploy/README.md and the newest whose schemas kubernetes-validate bundles.
OLDEST_K8S = "1.29"


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@cache
def readme() -> str:
    return (DEPLOY / "README.md").read_text()


def kustomization(folder: Path) -> dict[str, Any]:
    return yaml.safe_load((folder / KUSTOMIZATION_FILE).read_text())


def apply_path(folder: Path) -> list[Path]:
    """The files deploying ``folder`` applies: a kustomization's resources (followed into nested
    kustomizations) when it has one, else every YAML file in it, as ``kubectl apply -f DIR``."""
    if not (folder / KUSTOMIZATION_FILE).is_file():
        return sorted(p for p in folder.glob("*.y*ml"))
    out = []
    for entry in kustomization(folder).get("resources", []):
        path = (folder / entry).resolve()
        out.extend(apply_path(path) if path.is_dir() else [path])
    return out


@cache
def manifests() -> tuple[tuple[Path, dict[str, Any]], ...]:
    """Every Kubernetes object deploy/ applies, with the file it came from."""
    out = []
    for folder in KUSTOMIZATIONS:
        if not folder.is_dir():
            continue
        for path in apply_path(folder):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc is not None:
                    out.append((path, doc))
    return tuple(out)


@dataclass(frozen=True)
class SecretCommand:
    namespace: str
    name: str
    keys: frozenset[str]


def readme_secret_commands() -> list[SecretCommand]:
    """The `kubectl ... create secret generic NAME --from-literal=KEY=...` commands of the README."""
    text = readme().replace("\\\n", " ")
    out = []
    for match in re.finditer(r"kubectl\s+(?:-n\s+(\S+)\s+)?create secret generic\s+(\S+)([^\n]*)", text):
        keys = frozenset(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", match.group(3)))
        out.append(SecretCommand(match.group(1) or "default", match.group(2), keys))
    return out


def objects(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc.get("kind") == kind]


def one(kind: str) -> dict[str, Any]:
    found = objects(kind)
    if len(found) != 1:
        raise AssertionError(f"expected exactly one {kind} under deploy/k8s, found {len(found)}")
    return found[0]


def ray_cluster() -> dict[str, Any]:
    return one("RayCluster")


def ray_job() -> dict[str, Any]:
    return one("RayJob")


def service_deployment() -> dict[str, Any]:
    (dep,) = [d for d in objects("Deployment") if d["metadata"]["name"] == "tail-ray-service"]
    return dep


def service_service() -> dict[str, Any]:
    (svc,) = [s for s in objects("Service") if s["metadata"]["name"] == "tail-ray-service"]
    return svc


@dataclass(frozen=True)
class PodTemplate:
    where: str  # e.g. "RayCluster/tail-ray head"
    template: dict[str, Any]
    ray_node: bool  # a Ray head or worker (needs the cluster token and the shared volume)

    @property
    def spec(self) -> dict[str, Any]:
        return self.template["spec"]

    @property
    def containers(self) -> list[dict[str, Any]]:
        return self.spec["containers"]

    @property
    def main(self) -> dict[str, Any]:
        """The first container: the one KubeRay starts Ray in / the one the app runs in."""
        return self.containers[0]


def pod_templates() -> list[PodTemplate]:
    """Every pod template in deploy/k8s, wherever it is nested."""
    out = []
    for _, doc in manifests():
        kind, name = doc["kind"], doc["metadata"]["name"]
        spec = doc.get("spec", {})
        if kind == "RayCluster":
            out.append(PodTemplate(f"{kind}/{name} head", spec["headGroupSpec"]["template"], True))
            for group in spec.get("workerGroupSpecs", []):
                out.append(PodTemplate(f"{kind}/{name} {group['groupName']}", group["template"], True))
        elif kind == "RayJob" and "submitterPodTemplate" in spec:
            out.append(PodTemplate(f"{kind}/{name} submitter", spec["submitterPodTemplate"], False))
        elif kind in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            out.append(PodTemplate(f"{kind}/{name}", spec["template"], False))
    return out


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def ports_of(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


# --- Dockerfiles ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def dockerfile(name: str) -> list[Instruction]:
    """Instructions of deploy/<name>, with line continuations joined and comments dropped."""
    text = (DEPLOY / name).read_text()
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    out = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
    return out


def arg_defaults(instructions: list[Instruction], build_args: dict[str, str] | None = None) -> dict[str, str]:
    """The ARG values of a build: their defaults, overridden by ``--build-arg`` values."""
    out = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            key, _, value = ins.args.partition("=")
            out.setdefault(key.strip(), value.strip().strip('"'))
    return {**out, **(build_args or {})}


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def pip_installs(instructions: list[Instruction]) -> list[list[str]]:
    """The argument lists of every `pip install` in RUN lines (split at && and ;)."""
    out = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for part in re.split(r"&&|;", ins.args):
            words = shlex.split(part)
            if words[:2] == ["pip", "install"] or words[:4] == ["python", "-m", "pip", "install"]:
                out.append(words[words.index("install") + 1 :])
    return out


# --- names the service defines (read from its source) --------------------------------------


def _service_string_constants() -> set[str]:
    found: set[str] = set()
    for path in sorted((REPO / "service").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
            elif isinstance(node, ast.JoinedStr):  # f"tail_ray_{name}": keep the literal head
                head = node.values[0] if node.values else None
                if isinstance(head, ast.Constant) and isinstance(head.value, str):
                    found.add(head.value + "*")
    return found


def service_metric_names() -> set[str]:
    """Prometheus metric names the service's source spells out (``tail_ray_...``)."""
    names = set()
    for const in _service_string_constants():
        names.update(re.findall(r"\b(tail_ray_[a-z0-9_]+\*?)", const))
    return names


def service_env_names() -> set[str]:
    """TAIL_RAY_* variables the service's pydantic Settings reads (prefix + field name)."""
    path = REPO / "service" / "settings.py"
    if not path.exists():
        return set()
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(
            getattr(base, "id", None) == "BaseSettings" for base in node.bases
        ):
            for stmt in node.body:
                is_field = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                if is_field and stmt.target.id != "model_config":
                    out.add("TAIL_RAY_" + stmt.target.id.upper())
    return out
