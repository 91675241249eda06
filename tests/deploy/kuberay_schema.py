"""Validate ray.io/v1 objects against KubeRay's own CRD schemas, the way the API server does.

The schemas are the ``openAPIV3Schema`` of KubeRay's CRDs for each release in ``kuberay_crds/``
(see its README.md for where they come from). A CRD schema is a *structural* OpenAPI schema with
Kubernetes extensions; this module turns it into JSON Schema with the semantics the API server
gives it on ``kubectl apply`` (server-side field validation is ``Strict`` by default since
kubectl 1.27):

- an unknown field is an error (the API server would prune it, and strict validation rejects a
  request that relies on pruning), except under ``x-kubernetes-preserve-unknown-fields``;
- ``x-kubernetes-int-or-string`` takes an integer or a string, ``nullable`` takes null;
- ``format: int32/int64`` are range checks;
- ``x-kubernetes-list-type: map/set`` lists must not repeat a key / an item;
- ``x-kubernetes-validations`` (CEL) rules are not evaluated here: an object that sets a field
  carrying one is reported as an error, so nothing passes unchecked;
- the top-level ``metadata`` (``type: object`` in every CRD, validated by the API server itself)
  is checked against Kubernetes' own ObjectMeta schema.

On top of the CRD, every pod template a RayCluster or RayJob embeds is validated against the
strict Kubernetes schema (from ``kubernetes-validate``) of the target Kubernetes version, because
that is what the API server applies when the operator creates those pods: the CRD's copy of the
pod schema is the one KubeRay was built with, not the cluster's.
"""

from __future__ import annotations

import copy
import gzip
import json
from collections.abc import Iterator
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
from referencing.jsonschema import DRAFT202012

CRD_DIR = Path(__file__).resolve().parent / "kuberay_crds"
K8S_DEFS_URI = "https://kubernetes.io/api/_definitions.json"
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


@cache
def crd_index() -> dict[str, Any]:
    return json.loads((CRD_DIR / "index.json").read_text())


def supported_versions() -> tuple[str, ...]:
    """The KubeRay releases deploy/ supports, oldest first (from kuberay_crds/index.json)."""
    return tuple(crd_index()["supported"])


def below_range_versions() -> tuple[str, ...]:
    return tuple(crd_index()["below_range"])


@cache
def _crd_schema(file_name: str) -> dict[str, Any]:
    with gzip.open(CRD_DIR / file_name, "rt") as fh:
        return json.load(fh)


def _convert(node: Any) -> Any:
    """A CRD structural schema node as JSON Schema (draft 2020-12) with API-server semantics."""
    if isinstance(node, list):
        return [_convert(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _convert(v) for k, v in node.items() if k not in ("default", "format", "nullable")}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("anyOf", None)
        out["type"] = ["integer", "string"]
    fmt = node.get("format")
    if fmt in INT_RANGES and node.get("type") == "integer":
        out["minimum"], out["maximum"] = INT_RANGES[fmt]
    if node.get("nullable") and "type" in out:
        out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
    is_object = node.get("type") == "object"
    keeps_unknown = node.get("x-kubernetes-preserve-unknown-fields", False)
    if is_object and "additionalProperties" not in node and not keeps_unknown:
        out["additionalProperties"] = False
    if node.get("x-kubernetes-list-type") == "map":
        # Keep the item defaults: a missing key (e.g. a port's protocol) takes its default.
        out["x-tail-ray-item-defaults"] = {
            key: node["items"]["properties"][key]["default"]
            for key in node.get("x-kubernetes-list-map-keys", [])
            if "default" in node["items"].get("properties", {}).get(key, {})
        }
    return out


def _k8s_ref(name: str) -> dict[str, str]:
    return {"$ref": f"{K8S_DEFS_URI}#/$defs/{name}"}


@cache
def json_schema(kuberay_version: str, kind: str) -> dict[str, Any]:
    """KubeRay ``kuberay_version``'s CRD schema for ``kind`` as JSON Schema."""
    entry = crd_index()["versions"].get(kuberay_version)
    if entry is None:
        have = sorted(crd_index()["versions"])
        raise KeyError(f"no CRD schemas for KubeRay {kuberay_version}; have {have}")
    schema = _convert(copy.deepcopy(_crd_schema(entry[kind]["file"])))
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": kind}
    schema["properties"]["metadata"] = _k8s_ref("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return schema


def _cel_rules(validator: Any, rules: list[dict[str, str]], instance: Any, schema: dict) -> Iterator[Any]:
    listed = "; ".join(r["rule"] for r in rules)
    yield jsonschema.ValidationError(f"sets a field with CEL rules not evaluated offline: {listed}")


def _list_type(validator: Any, list_type: str, instance: Any, schema: dict) -> Iterator[Any]:
    if not isinstance(instance, list):
        return
    if list_type == "set":
        seen = [json.dumps(item, sort_keys=True) for item in instance]
        for dup in {s for s in seen if seen.count(s) > 1}:
            yield jsonschema.ValidationError(f"list-type set has a duplicate item {dup}")
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        defaults = schema.get("x-tail-ray-item-defaults", {})
        seen_keys: set[tuple[Any, ...]] = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, defaults.get(k)) for k in keys)
            if key in seen_keys:
                duplicate = dict(zip(keys, key, strict=True))
                yield jsonschema.ValidationError(f"list-type map has two items with {duplicate}")
            seen_keys.add(key)


CrdValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    {"x-kubernetes-validations": _cel_rules, "x-kubernetes-list-type": _list_type},
)


@cache
def _registry(k8s_version: str) -> referencing.Registry:
    minor = kubernetes_validate.utils.major_minor(k8s_version)
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{minor}.0-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    resource = referencing.Resource.from_contents(definitions, default_specification=DRAFT202012)
    return referencing.Registry().with_resource(K8S_DEFS_URI, resource)


def _errors(validator: Any, doc: Any, prefix: str = "") -> list[str]:
    out = []
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        path = ".".join(filter(None, [prefix, *(str(p) for p in err.absolute_path)])) or "<root>"
        out.append(f"{path}: {err.message}")
    return out


def embedded_pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(path, template) of every pod template a RayCluster / RayJob carries."""
    spec = doc.get("spec") or {}
    clusters = [("spec", spec)] if doc.get("kind") == "RayCluster" else []
    if doc.get("kind") == "RayJob":
        if "rayClusterSpec" in spec:
            clusters.append(("spec.rayClusterSpec", spec["rayClusterSpec"]))
        if "submitterPodTemplate" in spec:
            yield "spec.submitterPodTemplate", spec["submitterPodTemplate"]
    for where, cluster in clusters:
        if "template" in cluster.get("headGroupSpec", {}):
            yield f"{where}.headGroupSpec.template", cluster["headGroupSpec"]["template"]
        for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
            if "template" in group:
                yield f"{where}.workerGroupSpecs.{i}.template", group["template"]


def kuberay_errors(doc: dict[str, Any], kuberay_version: str, k8s_version: str) -> list[str]:
    """Every violation of a ray.io/v1 object, as 'path: message' (empty when valid): against the
    CRD of ``kuberay_version``, and its pod templates against Kubernetes ``k8s_version``."""
    kind = doc.get("kind")
    if kind not in ("RayCluster", "RayJob"):
        return [f"kind {kind!r} has no KubeRay CRD here; known: RayCluster, RayJob"]
    registry = _registry(k8s_version)
    errors = _errors(CrdValidator(json_schema(kuberay_version, kind), registry=registry), doc)
    pod_template = {**_k8s_ref("io.k8s.api.core.v1.PodTemplateSpec")}
    pod_validator = jsonschema.Draft202012Validator(pod_template, registry=registry)
    for where, template in embedded_pod_templates(doc):
        errors += _errors(pod_validator, template, prefix=where)
    return errors
