"""A structural JSON Schema for the KubeRay ``ray.io/v1`` kinds deploy/ uses (RayCluster, RayJob).

kubernetes-validate ships the Kubernetes API's own schemas, not the KubeRay CRDs. So the ray.io
objects are checked against this schema: field names and types of KubeRay's Go API types
(``ray-operator/apis/ray/v1/{raycluster,rayjob}_types.go``, KubeRay 1.1 to 1.6), unknown fields
rejected (a typo is an error, as with ``kubectl apply --validate=strict`` against the installed
CRD), and every embedded Kubernetes type (pod templates, env vars, resources, metadata) checked by
``$ref`` against the strict Kubernetes schema kubernetes-validate bundles, so a pod template inside
a RayCluster is held to the same rules as one inside a Deployment.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
from referencing.jsonschema import DRAFT202012

K8S_DEFS_URI = "https://kubernetes.io/api/_definitions.json"

INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def k8s(name: str) -> dict[str, Any]:
    """A reference to a Kubernetes API type, e.g. ``k8s("core.v1.PodTemplateSpec")``."""
    prefix = "io.k8s.apimachinery.pkg.apis." if name.startswith("meta.") else "io.k8s.api."
    return {"$ref": f"{K8S_DEFS_URI}#/$defs/{prefix}{name}"}


def obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


AUTOSCALER_OPTIONS = obj(
    {
        "resources": k8s("core.v1.ResourceRequirements"),
        "image": STR,
        "imagePullPolicy": {"enum": ["Always", "Never", "IfNotPresent"]},
        "securityContext": k8s("core.v1.SecurityContext"),
        "idleTimeoutSeconds": INT32,
        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
        "version": {"enum": ["v1", "v2"]},
        "env": {"type": "array", "items": k8s("core.v1.EnvVar")},
        "envFrom": {"type": "array", "items": k8s("core.v1.EnvFromSource")},
        "volumeMounts": {"type": "array", "items": k8s("core.v1.VolumeMount")},
    }
)

HEAD_GROUP_SPEC = obj(
    {
        "template": k8s("core.v1.PodTemplateSpec"),
        "headService": k8s("core.v1.Service"),
        "enableIngress": BOOL,
        # map[string]string: `num-cpus: 2` (an int) is rejected by the real CRD too.
        "rayStartParams": STR_MAP,
        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
        "resources": STR_MAP,
        "labels": STR_MAP,
    },
    required=("template",),
)

WORKER_GROUP_SPEC = obj(
    {
        "suspend": BOOL,
        "groupName": {"type": "string", "minLength": 1},
        "replicas": INT32,
        "minReplicas": INT32,
        "maxReplicas": INT32,
        "idleTimeoutSeconds": INT32,
        "rayStartParams": STR_MAP,
        "template": k8s("core.v1.PodTemplateSpec"),
        "scaleStrategy": obj({"workersToDelete": {"type": "array", "items": STR}}),
        "numOfHosts": INT32,
        "resources": STR_MAP,
        "labels": STR_MAP,
    },
    required=("groupName", "minReplicas", "maxReplicas", "template"),
)

AUTH_OPTIONS = obj({"mode": {"enum": ["disabled", "token"]}, "secretName": STR, "enableK8sTokenAuth": BOOL})

RAY_CLUSTER_SPEC = obj(
    {
        "suspend": BOOL,
        "managedBy": {"enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]},
        "autoscalerOptions": AUTOSCALER_OPTIONS,
        "headServiceAnnotations": STR_MAP,
        "enableInTreeAutoscaling": BOOL,
        "gcsFaultToleranceOptions": {"type": "object"},
        "authOptions": AUTH_OPTIONS,
        "headGroupSpec": HEAD_GROUP_SPEC,
        "rayVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
        "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP_SPEC},
    },
    required=("headGroupSpec",),
)

RAY_JOB_SPEC = {
    **obj(
        {
            "activeDeadlineSeconds": {**INT32, "minimum": 1},
            "backoffLimit": INT32,
            "rayClusterSpec": RAY_CLUSTER_SPEC,
            "submitterPodTemplate": k8s("core.v1.PodTemplateSpec"),
            "metadata": STR_MAP,
            "clusterSelector": STR_MAP,
            "submitterConfig": obj({"backoffLimit": INT32}),
            "managedBy": {"enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]},
            "deletionPolicy": {"enum": ["DeleteCluster", "DeleteWorkers", "DeleteSelf", "DeleteNone"]},
            "deletionStrategy": {"type": "object"},
            "entrypoint": {"type": "string", "minLength": 1},
            "runtimeEnvYAML": STR,
            "jobId": STR,
            "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
            "entrypointResources": STR,
            "entrypointNumCpus": {"type": "number", "minimum": 0},
            "entrypointNumGpus": {"type": "number", "minimum": 0},
            "ttlSecondsAfterFinished": INT32,
            "shutdownAfterJobFinishes": BOOL,
            "suspend": BOOL,
        },
        required=("entrypoint",),
    ),
    # A RayJob either brings its own cluster or picks an existing one, never both.
    "oneOf": [
        {"required": ["rayClusterSpec"], "not": {"required": ["clusterSelector"]}},
        {"required": ["clusterSelector"], "not": {"required": ["rayClusterSpec"]}},
    ],
}


def _top(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return obj(
        {
            "apiVersion": {"const": "ray.io/v1"},
            "kind": {"const": kind},
            "metadata": k8s("meta.v1.ObjectMeta"),
            "spec": spec,
        },
        required=("apiVersion", "kind", "metadata", "spec"),
    )


SCHEMAS = {"RayCluster": _top("RayCluster", RAY_CLUSTER_SPEC), "RayJob": _top("RayJob", RAY_JOB_SPEC)}


@cache
def _registry(k8s_version: str) -> referencing.Registry:
    minor = kubernetes_validate.utils.major_minor(k8s_version)
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{minor}.0-local-strict"
    definitions = json.loads((folder / "_definitions.json").read_text())
    resource = referencing.Resource.from_contents(definitions, default_specification=DRAFT202012)
    return referencing.Registry().with_resource(K8S_DEFS_URI, resource)


def kuberay_errors(doc: dict[str, Any], k8s_version: str) -> list[str]:
    """Every schema violation of a ray.io/v1 object, as 'path: message' (empty when valid)."""
    kind = doc.get("kind")
    if kind not in SCHEMAS:
        return [f"kind {kind!r} has no KubeRay schema here; known: {sorted(SCHEMAS)}"]
    validator = jsonschema.Draft202012Validator(SCHEMAS[kind], registry=_registry(k8s_version))
    return [
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
