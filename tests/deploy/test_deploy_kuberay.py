"""The RayCluster and the RayJob against KubeRay's own CRD schemas, for every KubeRay release
deploy/ supports (kept in kuberay_crds/, see its README.md); the Ray token reaches the operator as
well as the pods; and deploy/README.md pins and states exactly that range."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
from deploy_support import (
    OLDEST_K8S,
    env_of,
    manifests,
    pod_templates,
    ray_cluster,
    ray_job,
    readme,
    readme_secret_commands,
    service_deployment,
)
from kuberay_schema import (
    below_range_versions,
    crd_index,
    json_schema,
    kuberay_errors,
    supported_versions,
)
from packaging.version import Version

NEWEST_K8S = kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version())
K8S_VERSIONS = (OLDEST_K8S, NEWEST_K8S)
NEWEST_KUBERAY = supported_versions()[-1]
# KubeRay's own names (ray-operator/controllers/ray/utils/constant.go): the data key it reads the
# token from in the Secret authOptions.secretName names.
KUBERAY_TOKEN_KEY = "auth_token"
# KubeRay refuses authOptions.mode=token below this Ray (ValidateRayClusterSpec, 1.6 and 1.7).
MIN_RAY_FOR_TOKEN_AUTH = Version("2.52.0")


def _ray_objects() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path, doc in manifests() if doc["apiVersion"] == "ray.io/v1"]


# --- the CRDs of every supported release -------------------------------------------------------


def test_crd_test_data_covers_the_supported_range():
    index = crd_index()
    assert index["source"] == "https://github.com/ray-project/kuberay"
    assert len(supported_versions()) >= 2 and below_range_versions()
    ordered = sorted(supported_versions(), key=lambda v: Version(v.lstrip("v")))
    assert list(supported_versions()) == ordered
    assert max(map(Version, below_range_versions())) < Version(supported_versions()[0])
    for tag in (*supported_versions(), *below_range_versions()):
        entry = index["versions"][tag]
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]), tag
        for kind in ("RayCluster", "RayJob"):
            schema = json_schema(tag, kind)
            assert {"spec", "metadata"} <= set(schema["properties"]), (tag, kind)


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize("kuberay", supported_versions())
def test_ray_objects_validate_against_kuberays_own_crds(kuberay, k8s):
    """What `kubectl apply` would get from the API server with KubeRay `kuberay`'s CRDs
    installed, and the pod templates as Kubernetes `k8s` validates the pods KubeRay creates."""
    objects = _ray_objects()
    assert {doc["kind"] for _, doc in objects} == {"RayCluster", "RayJob"}
    for name, doc in objects:
        errors = kuberay_errors(doc, kuberay, k8s)
        assert not errors, f"{name} {doc['kind']} (KubeRay {kuberay}, k8s {k8s}): {errors}"


@pytest.mark.parametrize("kuberay", below_range_versions())
def test_the_range_starts_where_the_manifests_start_to_validate(kuberay):
    """The release line below the supported range rejects the RayCluster, for the field that
    sets its lower bound (authOptions.secretName came in 1.6.0): the range is not a guess."""
    errors = kuberay_errors(ray_cluster(), kuberay, NEWEST_K8S)
    assert errors and all("secretName" in e for e in errors), errors


def test_crd_validation_bites():
    """Mistakes the API server would refuse are errors here: an unknown field, a wrong type, a
    missing required field, an out-of-range int32, a duplicate key in a list-map, a field with a
    CEL rule we cannot evaluate, and a pod template field unknown to Kubernetes."""

    def errors(doc: dict) -> list[str]:
        return kuberay_errors(doc, NEWEST_KUBERAY, NEWEST_K8S)

    def cluster() -> dict:
        return copy.deepcopy(ray_cluster())

    rc = cluster()
    rc["spec"]["authOptions"]["secretname"] = "x"  # case typo
    assert any("secretname" in e for e in errors(rc))
    rc = cluster()
    rc["spec"]["authOptions"]["mode"] = "Token"
    assert any("authOptions.mode" in e for e in errors(rc))
    rc = cluster()
    rc["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 2  # must be a string
    assert any("num-cpus" in e for e in errors(rc))
    rc = cluster()
    del rc["spec"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in errors(rc))
    rc = cluster()
    rc["spec"]["workerGroupSpecs"][0]["maxReplicas"] = 2**31
    assert any("maxReplicas" in e for e in errors(rc))
    rc = cluster()
    ports = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append({"containerPort": ports[0]["containerPort"], "name": "again"})
    assert any("list-type map" in e for e in errors(rc))
    rc = cluster()
    rc["spec"]["managedBy"] = "ray.io/kuberay-operator"
    assert any("CEL" in e for e in errors(rc))
    rc = cluster()
    rc["metadata"]["labels"] = {"ok": 1}  # ObjectMeta: label values are strings
    assert any("metadata.labels" in e for e in errors(rc))
    rc = cluster()
    rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resource"] = {}
    assert any("resource" in e for e in errors(rc))

    job = copy.deepcopy(ray_job())
    job["spec"]["backoffLimit"] = "0"
    assert any("backoffLimit" in e for e in errors(job))
    job = copy.deepcopy(ray_job())
    job["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["env"][0]["valueFromm"] = {}
    assert any("valueFromm" in e for e in errors(job))


# --- the token reaches the pods and the operator ------------------------------------------------


def _ray_token_refs() -> dict[str, tuple[str, str]]:
    """Where each Ray process gets RAY_AUTH_TOKEN from: (Secret name, key)."""
    containers = [(pod.where, pod.main) for pod in pod_templates()]
    containers.append(("RayCluster autoscaler", ray_cluster()["spec"]["autoscalerOptions"]))
    out = {}
    for where, container in containers:
        item = env_of(container).get("RAY_AUTH_TOKEN", {})
        ref = item.get("valueFrom", {}).get("secretKeyRef", {})
        out[where] = (ref.get("name"), ref.get("key"))
    return out


def test_the_operator_gets_the_token_the_pods_use():
    """KubeRay's dashboard client sends the Ray token only when authOptions.mode is `token`, and
    takes it from the Secret authOptions.secretName names (data key auth_token). Without that
    the operator gets 401 from Ray 2.60's Jobs API and a RayJob never leaves Running; with a
    different Secret it authenticates with a token the cluster does not have."""
    spec = ray_cluster()["spec"]
    auth = spec.get("authOptions")
    assert auth, "RayCluster has no spec.authOptions: the operator cannot read job status"
    assert auth.get("mode") == "token", auth
    assert not auth.get("enableK8sTokenAuth"), "Kubernetes token auth is not supported for RayJobs"
    secret = auth.get("secretName")
    assert secret, "authOptions.secretName: without it KubeRay generates a token of its own"
    refs = _ray_token_refs()
    assert len(refs) >= 4, refs
    wrong = {where: ref for where, ref in refs.items() if ref != (secret, KUBERAY_TOKEN_KEY)}
    assert not wrong, f"these read another token than authOptions' {secret}/{KUBERAY_TOKEN_KEY}: {wrong}"
    # The control plane talks to the same cluster with the same token.
    service_env = env_of(service_deployment()["spec"]["template"]["spec"]["containers"][0])
    for name in ("RAY_AUTH_TOKEN", "TAIL_RAY_RAY_AUTH_TOKEN"):
        ref = service_env[name]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret, KUBERAY_TOKEN_KEY), name
    # The Secret is one the README makes, with the key KubeRay reads.
    made = {cmd.name: cmd.keys for cmd in readme_secret_commands() if cmd.namespace == "tail-ray"}
    assert KUBERAY_TOKEN_KEY in made.get(secret, set()), f"README creates no {secret}/{KUBERAY_TOKEN_KEY}"
    # KubeRay refuses token auth below Ray 2.52.
    assert Version(spec["rayVersion"]) >= MIN_RAY_FOR_TOKEN_AUTH


def test_rayjob_fits_kuberays_clusterselector_rules():
    """KubeRay's own checks for a RayJob on an existing cluster (ValidateRayJobSpec): no retries
    (backoffLimit > 0 is refused with a clusterSelector), not SidecarMode, a cluster name."""
    spec = ray_job()["spec"]
    assert spec["clusterSelector"].get("ray.io/cluster") == ray_cluster()["metadata"]["name"]
    assert spec.get("backoffLimit", 0) == 0
    assert spec.get("submissionMode", "K8sJobMode") != "SidecarMode"
    assert not spec.get("suspend")


# --- the README pins and states the same range -------------------------------------------------


def _plain(tag: str) -> str:
    return tag.removeprefix("v")


def test_readme_pins_the_operator_to_a_supported_release():
    installs = re.findall(
        r"helm (?:install|upgrade --install) [^\n]*kuberay/kuberay-operator[^\n]*", readme()
    )
    assert installs, "deploy/README.md does not install the KubeRay operator with helm"
    supported = {_plain(v) for v in supported_versions()}
    for command in installs:
        pinned = re.search(r"--version[ =](\S+)", command)
        assert pinned, f"unpinned operator install: {command}"
        version = pinned.group(1).strip("\"'")
        if version.startswith("$"):  # a shell variable: its assignment in the README
            (assigned,) = re.findall(rf"{version[1:].strip('{}')}=(\S+)", readme())
            version = assigned
        assert version in supported, f"pins KubeRay {version}; validated: {sorted(supported)}"


def test_readme_states_the_supported_range():
    stated = re.search(r"Supported KubeRay operator: \*{0,2}(\d+\.\d+\.\d+) to (\d+\.\d+\.\d+)", readme())
    assert stated, "deploy/README.md does not state the supported KubeRay range"
    first, last = _plain(supported_versions()[0]), _plain(supported_versions()[-1])
    assert stated.groups() == (first, last)
