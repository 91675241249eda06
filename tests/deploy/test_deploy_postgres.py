"""deploy/k8s-postgres: the base cluster with the control plane as two replicas on PostgreSQL.
Rendered by `kubectl kustomize` (what `kubectl apply -k` runs), then checked like the base: valid
objects, the service's own settings, a Secret the README creates, and what makes two replicas
safe (rolling updates that keep both up, a disruption budget, no SQLite volume left behind)."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    DEPLOY,
    OLDEST_K8S,
    env_of,
    manifests,
    readme,
    readme_secret_commands,
    service_env_names,
)
from kuberay_schema import kuberay_errors, supported_versions

OVERLAY = DEPLOY / "k8s-postgres"
DATABASE_SECRET = ("tail-ray-database", "url")
NEWEST_K8S = kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version())
pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (its kustomize) not installed"
)


@cache
def rendered() -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def _one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in rendered() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _container() -> dict[str, Any]:
    return _one("Deployment", "tail-ray-service")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("version", (OLDEST_K8S, NEWEST_K8S))
def test_the_overlay_renders_valid_objects(version: str) -> None:
    for doc in rendered():
        if doc["apiVersion"] == "ray.io/v1":
            errors = kuberay_errors(doc, supported_versions()[-1], version)
        else:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
                errors = []
            except kubernetes_validate.ValidationError as err:
                errors = [f"{'.'.join(map(str, err.path))}: {err.message}"]
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): {errors}"


def test_the_base_is_unchanged_but_for_the_control_planes_storage() -> None:
    base = {(d["kind"], d["metadata"]["name"]) for _, d in manifests() if d["kind"] != "RayJob"}
    here = {(d["kind"], d["metadata"]["name"]) for d in rendered()}
    assert here == base - {("PersistentVolumeClaim", "tail-ray-service-data")} | {
        ("PodDisruptionBudget", "tail-ray-service")
    }
    (base_cluster,) = [d for _, d in manifests() if d["kind"] == "RayCluster"]
    assert _one("RayCluster", "tail-ray") == base_cluster


def test_two_replicas_that_updates_and_drains_keep_serving() -> None:
    dep = _one("Deployment", "tail-ray-service")
    replicas = dep["spec"]["replicas"]
    assert replicas == 2
    strategy = dep["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    budget = _one("PodDisruptionBudget", "tail-ray-service")
    assert 1 <= budget["spec"]["minAvailable"] < replicas
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_replicas_use_postgresql_from_a_secret_and_no_volume() -> None:
    container = _container()
    env = env_of(container)
    known = service_env_names()
    assert {name for name in env if name.startswith("TAIL_RAY_")} <= known
    assert "TAIL_RAY_DB_PATH" not in env
    ref = env["TAIL_RAY_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == DATABASE_SECRET and "value" not in env["TAIL_RAY_DATABASE_URL"]
    made = {c.name: c.keys for c in readme_secret_commands() if c.namespace == "tail-ray"}
    assert DATABASE_SECRET[1] in made.get(DATABASE_SECRET[0], set()), "deploy/README.md must create it"
    pod = _one("Deployment", "tail-ray-service")["spec"]["template"]["spec"]
    assert not container.get("volumeMounts") and not pod.get("volumes")
    assert not [d for d in rendered() if d["kind"] == "PersistentVolumeClaim" and "ReadWriteOncePod" in
                d["spec"]["accessModes"]]  # fmt: skip
    assert "kubectl apply -k deploy/k8s-postgres" in readme()


def test_the_service_accepts_the_url_the_readme_documents() -> None:
    from service.settings import Settings

    settings = Settings(api_token="t" * 32, database_url="postgresql://tailray:pw@db.example:5432/tailray")
    assert settings.storage_url.startswith("postgresql://")
    with pytest.raises(ValueError, match="use sqlite:///path"):
        Settings(api_token="t" * 32, database_url="mysql://db.example/tailray")


def test_overlay_files_are_all_used() -> None:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    listed = {Path(p) for p in kustomization["resources"] if not p.startswith("..")}
    listed |= {Path(p["path"]) for p in kustomization["patches"]}
    files = {p.relative_to(OVERLAY) for p in OVERLAY.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert files == listed
