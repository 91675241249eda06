"""deploy/: every file parses, the Kubernetes manifests validate, and they agree with each other
and with the code they run (job config, service settings, Ray token auth, elastic range). The
ray.io objects against KubeRay's own CRDs: test_deploy_kuberay.py."""

from __future__ import annotations

import copy
import importlib
import json
import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    DEPLOY,
    K8S,
    KUSTOMIZATION_FILE,
    KUSTOMIZATIONS,
    OLDEST_K8S,
    REPO,
    apply_path,
    arg_defaults,
    dockerfile,
    env_of,
    kustomization,
    manifests,
    objects,
    pod_templates,
    ports_of,
    pyproject,
    ray_cluster,
    ray_job,
    readme,
    readme_secret_commands,
    service_deployment,
    service_env_names,
    service_service,
    walk,
)
from fastapi.testclient import TestClient
from kuberay_schema import kuberay_errors, supported_versions

NEWEST_K8S = kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version())
K8S_VERSIONS = (OLDEST_K8S, NEWEST_K8S)
NAMESPACE = "tail-ray"
RAY_IMAGE_HOME = Path("/home/ray")  # the home of user `ray` in the rayproject/ray images
RAY_SECRET = ("ray-auth-token", "auth_token")
API_SECRET = ("tail-ray-api-token", "token")


def k8s_errors(doc: dict, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [f"{'.'.join(map(str, err.path))}: {err.message}"]
    return []


def validation_errors(doc: dict, version: str) -> list[str]:
    if doc["apiVersion"] == "ray.io/v1":
        # Every supported KubeRay: test_deploy_kuberay.py; here the newest, with the pod
        # templates against this Kubernetes version.
        return kuberay_errors(doc, supported_versions()[-1], version)
    return k8s_errors(doc, version)


# --- parsing and schema validation -----------------------------------------------------------


def test_every_yaml_and_json_under_deploy_parses():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml", ".json"})
    assert len(files) >= 7, files  # k8s manifests, prometheus, grafana
    for path in files:
        text = path.read_text()
        docs = [json.loads(text)] if path.suffix == ".json" else list(yaml.safe_load_all(text))
        assert any(d is not None for d in docs), f"{path} is empty"


def test_manifests_cover_the_product():
    kinds = sorted({doc["kind"] for _, doc in manifests()})
    for kind in (
        "Namespace",
        "PersistentVolumeClaim",
        "RayCluster",
        "RayJob",
        "Deployment",
        "Service",
    ):
        assert kind in kinds, f"deploy/k8s has no {kind} (has {kinds})"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(version):
    checked = 0
    for path, doc in manifests():
        errors = validation_errors(doc, version)
        assert not errors, f"{path.name} {doc['kind']}/{doc['metadata']['name']} (k8s {version}): {errors}"
        checked += 1
    assert checked == len(manifests())


def test_validators_reject_mistakes():
    """The validators bite: a typo, a wrong type or a missing field in each kind is an error."""
    dep = copy.deepcopy(service_deployment())
    dep["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}  # case typo
    assert any("livenessprobe" in e for e in k8s_errors(dep, NEWEST_K8S))
    dep = copy.deepcopy(service_deployment())
    dep["spec"]["replicas"] = "one"
    assert k8s_errors(dep, NEWEST_K8S)
    svc = copy.deepcopy(service_service())
    svc["spec"]["port"] = 8000  # belongs in spec.ports
    assert k8s_errors(svc, NEWEST_K8S)

    rc = copy.deepcopy(ray_cluster())
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    assert any("enviroment" in e for e in validation_errors(rc, NEWEST_K8S))


# --- the manifests agree with each other -----------------------------------------------------


def test_everything_lives_in_one_namespace():
    (ns,) = objects("Namespace")
    assert ns["metadata"]["name"] == NAMESPACE
    for _, doc in manifests():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"


def _readme_secrets() -> dict[str, frozenset[str]]:
    return {cmd.name: cmd.keys for cmd in readme_secret_commands() if cmd.namespace == NAMESPACE}


def test_secret_and_volume_references_resolve():
    """Every Secret key a manifest reads is one deploy/README.md's `kubectl create secret`
    commands make (the Secrets are not in any applied file), and every claim exists."""
    secrets = _readme_secrets()
    assert set(secrets) >= {RAY_SECRET[0], API_SECRET[0]}, secrets
    claims = {c["metadata"]["name"]: c for c in objects("PersistentVolumeClaim")}
    refs = 0
    for _, doc in manifests():
        for node in walk(doc):
            if isinstance(node, dict) and "secretKeyRef" in node:
                ref = node["secretKeyRef"]
                assert ref["key"] in secrets.get(ref["name"], set()), f"{ref}: no README secret has it"
                refs += 1
            if isinstance(node, dict) and "persistentVolumeClaim" in node:
                assert node["persistentVolumeClaim"]["claimName"] in claims, node
    assert refs >= 5
    for pod in pod_templates():
        volumes = {v["name"] for v in pod.spec.get("volumes", [])}
        for container in pod.containers:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{pod.where}: mount {mount['name']} has no volume"


def test_no_secret_in_the_apply_path():
    """Re-applying deploy/k8s must never overwrite the real tokens: no Secret object, and no
    kustomize secretGenerator with inline values, in anything `kubectl apply` takes from there."""
    found = []
    for path in sorted(K8S.rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            if doc.get("kind") == "Secret":
                found.append(f"{path.relative_to(REPO)}: Secret/{doc.get('metadata', {}).get('name')}")
            for generator in doc.get("secretGenerator", []) if path.name == KUSTOMIZATION_FILE else []:
                if generator.get("literals"):
                    name = generator.get("name")
                    found.append(f"{path.relative_to(REPO)}: secretGenerator {name} with literals")
    assert not found, f"secrets in the apply path (create them with kubectl instead): {found}"


def test_every_file_under_k8s_is_applied_by_a_kustomization():
    """A YAML file no kustomization lists is applied by no documented command: it is dead, or
    someone applies it by hand with `kubectl apply -f`, which is how placeholder secrets got
    applied over real ones."""
    listed = {p for folder in KUSTOMIZATIONS for p in apply_path(folder)}
    components = {
        (folder / c).resolve()
        for folder in KUSTOMIZATIONS
        for c in kustomization(folder).get("components", [])
    }
    for path in sorted(K8S.rglob("*.y*ml")):
        if path.name == KUSTOMIZATION_FILE:
            assert path.parent.resolve() in {f.resolve() for f in KUSTOMIZATIONS} | components, path
            continue
        assert path.resolve() in listed, f"{path.relative_to(REPO)} is in no kustomization"


def test_readme_makes_random_tokens():
    """The README's secret commands generate each token (a random value, never a literal), in
    the command itself or in a shell variable the README sets from one (a database password
    that also goes into CREATE ROLE)."""
    text = readme().replace("\\\n", " ")
    random_vars = re.findall(r"^(\w+)=\$\(python3 -c '[^']*secrets\.token_[^']*'\)", text, flags=re.M)
    commands = re.findall(r"kubectl[^\n]*create secret generic[^\n]*", text)
    assert len(commands) >= 2, commands
    for command in commands:
        inline = "$(" in command and "secrets.token_" in command
        assert inline or any(f"${{{var}}}" in command for var in random_vars), command


def _is_secret_env(item: dict, secret: tuple[str, str]) -> bool:
    ref = item.get("valueFrom", {}).get("secretKeyRef", {})
    return (ref.get("name"), ref.get("key")) == secret and "value" not in item


def test_token_auth_on_every_ray_process():
    """Ray 2.60 token auth: every Ray node, the autoscaler, the job submitter and the control plane
    run with RAY_AUTH_MODE=token and the cluster token from the Secret, never inline. (That the
    operator gets it too: test_deploy_kuberay.py.)"""
    containers = [(pod.where, pod.main) for pod in pod_templates()]
    autoscaler = ray_cluster()["spec"]["autoscalerOptions"]
    containers.append(("RayCluster autoscaler", autoscaler))
    assert len(containers) >= 5
    for where, container in containers:
        env = env_of(container)
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", where
        assert _is_secret_env(env.get("RAY_AUTH_TOKEN", {}), RAY_SECRET), where
    # No token value is written inline anywhere.
    for _, doc in manifests():
        if doc["kind"] == "Secret":
            continue
        for node in walk(doc):
            if isinstance(node, dict) and "TOKEN" in str(node.get("name", "")).upper():
                assert "value" not in node, f"{doc['kind']}/{doc['metadata']['name']}: inline {node['name']}"


def test_one_image_everywhere_tagged_with_the_package_version():
    version = pyproject()["project"]["version"]
    images = {c["image"] for pod in pod_templates() for c in pod.containers}
    assert images == {f"tail-ray:{version}"}, images
    # Both kustomizations take the image from one component, which keeps that tag.
    (component,) = {
        (folder / c).resolve()
        for folder in KUSTOMIZATIONS
        for c in kustomization(folder).get("components", [])
    }
    for folder in KUSTOMIZATIONS:
        assert [(folder / c).resolve() for c in kustomization(folder)["components"]] == [component]
    (image,) = kustomization(component)["images"]
    assert (image["name"], image["newTag"]) == ("tail-ray", version)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) not installed")
@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda f: str(f.relative_to(DEPLOY)))
def test_kustomize_renders_the_files_with_the_registry_image(folder, tmp_path):
    """`kubectl kustomize` (what `kubectl apply -k` runs) renders exactly the objects of the files,
    with the image the component names in every container, the RayCluster's and RayJob's too."""
    copy_root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy_root)
    component = copy_root / "k8s" / "image" / KUSTOMIZATION_FILE
    text = component.read_text()
    assert "newName: tail-ray\n" in text
    component.write_text(text.replace("newName: tail-ray\n", "newName: registry.example.com/team/tail-ray\n"))
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(copy_root / folder.relative_to(DEPLOY))],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    expected = [doc for path, doc in manifests() if path in set(apply_path(folder))]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, docs)) == sorted(map(key, expected))
    containers = [n for d in docs for n in walk(d) if isinstance(n, dict) and "image" in n and "name" in n]
    version = pyproject()["project"]["version"]
    assert containers and {c["image"] for c in containers} == {
        f"registry.example.com/team/tail-ray:{version}"
    }


def test_ray_cluster_version_and_ports():
    cluster = ray_cluster()
    spec = cluster["spec"]
    assert spec["rayVersion"] == arg_defaults(dockerfile("Dockerfile"))["RAY_VERSION"]
    head = spec["headGroupSpec"]
    ports = ports_of(head["template"]["spec"]["containers"][0])
    # KubeRay's head Service exposes the container ports by these names.
    assert ports["gcs-server"] == 6379
    assert ports["dashboard"] == 8265
    assert ports["client"] == 10001
    for group in [head, *spec["workerGroupSpecs"]]:
        container = group["template"]["spec"]["containers"][0]
        assert int(group["rayStartParams"]["metrics-export-port"]) == ports_of(container)["metrics"]
    assert head["rayStartParams"].get("dashboard-host") == "0.0.0.0"  # reachable from the service pod


# --- the job and the elastic range -----------------------------------------------------------


def _train_argv() -> list[str]:
    argv = shlex.split(ray_job()["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "jobs.train"], argv
    return argv[3:]


def test_rayjob_runs_jobs_train_on_the_cluster():
    from jobs.train import parse_args

    args = parse_args(_train_argv())
    assert args.config == "jobs/configs/digits-tail.yaml"
    assert (REPO / args.config).is_file(), "the RayJob's config must ship in the image (jobs/configs)"
    assert args.address is None  # inside a Ray job, RAY_ADDRESS from the job supervisor is used

    job, cluster = ray_job(), ray_cluster()
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert job["metadata"]["namespace"] == cluster["metadata"]["namespace"]
    # The entrypoint's relative config path resolves in the directory Ray was started in.
    workdirs = {pod.main.get("workingDir") for pod in pod_templates() if pod.ray_node}
    assert workdirs == {"/home/ray/tail-ray"}, workdirs
    assert [i.args for i in dockerfile("Dockerfile") if i.keyword == "WORKDIR"] == ["/home/ray/tail-ray"]


def test_elastic_range_matches_the_worker_group():
    """minReplicas..maxReplicas of the worker group is exactly the job's min..max workers, as the
    runner hands them to Ray Train (its ScalingConfig, built from the RayJob's command line)."""
    from jobs.train import load_config, parse_args
    from tail_ray.runner.trainer import scaling_config

    args = parse_args(_train_argv())
    scaling = scaling_config(load_config(str(REPO / args.config), args.overrides))
    assert isinstance(scaling.num_workers, tuple), "the example job should be elastic"
    min_workers, max_workers = scaling.num_workers
    assert min_workers < max_workers
    per_worker = dict(scaling.resources_per_worker)
    assert set(per_worker) == {"CPU"}, f"a CPU job on a CPU worker group, got {per_worker}"

    spec = ray_cluster()["spec"]
    assert spec["enableInTreeAutoscaling"] is True, "Ray Train asks the autoscaler for max_workers"
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", "training must not land on the head"
    (group,) = spec["workerGroupSpecs"]
    pod_cpus = float(group["rayStartParams"]["num-cpus"])
    limit = group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
    assert float(limit) == pod_cpus, "Ray's num-cpus must be what the container may really use"
    workers_per_pod = math.floor(pod_cpus / per_worker["CPU"])
    assert workers_per_pod >= 1, f"a worker ({per_worker}) does not fit a pod ({pod_cpus} CPUs)"
    assert group["minReplicas"] * workers_per_pod == min_workers
    assert group["maxReplicas"] * workers_per_pod == max_workers


def test_autoscaled_worker_groups_leave_replicas_to_the_autoscaler():
    """With the in-tree autoscaler on, a `replicas` in the manifest is re-applied by every
    `kubectl apply` and resets a group the autoscaler grew mid-job."""
    spec = ray_cluster()["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    for group in spec["workerGroupSpecs"]:
        assert "replicas" not in group, f"worker group {group['groupName']} sets replicas"
        assert group["minReplicas"] <= group["maxReplicas"]


def test_rayjob_submitter_gets_kuberays_submit_command():
    """KubeRay fills in `ray job submit ... -- <entrypoint>` only when the submitter container
    has no command of its own."""
    (container,) = ray_job()["spec"]["submitterPodTemplate"]["spec"]["containers"]
    assert "command" not in container and "args" not in container
    assert ray_job()["spec"]["submitterPodTemplate"]["spec"]["restartPolicy"] == "Never"


def test_checkpoints_go_to_storage_every_ray_pod_shares():
    """Where the job checkpoints (its storage_path, or the runner's default under the home of the
    image's user) is a ReadWriteMany volume mounted on every Ray pod, so a restarted worker group
    finds the latest checkpoint wherever it lands. Jobs from the control plane set no
    storage_path, so the default must be shared too."""
    from jobs.train import load_config, parse_args
    from tail_ray.runner.trainer import DEFAULT_STORAGE_PATH

    args = parse_args(_train_argv())
    cfg = load_config(str(REPO / args.config), args.overrides)
    default_in_image = str(RAY_IMAGE_HOME / DEFAULT_STORAGE_PATH.relative_to(Path.home()))
    claims = {c["metadata"]["name"]: c for c in objects("PersistentVolumeClaim")}
    for storage_path in {cfg.storage_path or default_in_image, default_in_image}:
        for pod in pod_templates():
            if not pod.ray_node:
                continue
            volumes = {v["name"]: v for v in pod.spec["volumes"]}
            shared = [
                m
                for m in pod.main["volumeMounts"]
                if "persistentVolumeClaim" in volumes[m["name"]]
                and "ReadWriteMany"
                in claims[volumes[m["name"]]["persistentVolumeClaim"]["claimName"]]["spec"]["accessModes"]
                and storage_path.startswith(m["mountPath"].rstrip("/") + "/")
            ]
            assert shared, f"{pod.where}: checkpoints at {storage_path!r} are not on a shared RWX volume"


# --- the control plane -----------------------------------------------------------------------


def _uvicorn_app(argv: list[str]):
    """Build the app the container's command serves (without starting it): `python -m
    service.serve` (the service's own uvicorn runner) or a plain uvicorn command line."""
    if argv[:3] == ["python", "-m", "service.serve"]:
        argv = ["uvicorn", "--factory", "service.main:create_app", *argv[3:]]
    assert argv[0] == "uvicorn", argv
    factory = "--factory" in argv
    (target,) = [a for a in argv[1:] if ":" in a and not a.startswith("-")]
    module_name, _, attr = target.partition(":")
    obj = getattr(importlib.import_module(module_name), attr)
    if not factory:
        return obj
    from service.settings import Settings

    return obj(Settings(api_token="t" * 32, db_path=Path("/nonexistent/never-opened.sqlite")))


def test_service_deployment_runs_the_app_with_its_settings():
    dep = service_deployment()
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate", "SQLite: never two pods on one database"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    argv = container["command"] + container.get("args", [])
    port = int(argv[argv.index("--port") + 1])
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert ports_of(container)["http"] == port
    # The command names a real app, and the paths the probes and Prometheus use are its routes.
    app = _uvicorn_app(argv)
    routes = set(app.openapi()["paths"])
    assert {"/metrics", "/healthz", "/readyz"} <= routes
    client = TestClient(app)  # no lifespan: startup and liveness must answer without Ray or a database
    probes = {p: container[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    for probe, get in probes.items():
        assert get["port"] == "http", probe
        assert get["path"] in routes, probe
    # Alive is "the process serves"; ready is "it can run jobs": the database takes a write and
    # Ray answers. A Ray outage takes the pod out of the Service, it never restarts it.
    assert probes["readinessProbe"]["path"] == "/readyz"
    for probe in ("startupProbe", "livenessProbe"):
        assert probes[probe]["path"] == "/healthz", probe
        assert client.get(probes[probe]["path"]).status_code == 200, probe
    # /readyz waits up to the service's Ray timeout: the kubelet must wait longer, or a slow Ray
    # reads as a probe timeout instead of /readyz's own answer.
    from service.settings import Settings

    ray_timeout_s = Settings.model_fields["ray_timeout_s"].default
    assert container["readinessProbe"]["timeoutSeconds"] > ray_timeout_s

    env = env_of(container)
    known = service_env_names()
    assert known, "service/settings.py defines no TAIL_RAY_* settings"
    for name in env:
        if name.startswith("TAIL_RAY_"):
            assert name in known, f"{name} is not a setting of service/settings.py ({sorted(known)})"
    assert _is_secret_env(env["TAIL_RAY_API_TOKEN"], API_SECRET)

    # The database sits on the service's own volume, which only one pod may mount at a time.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    db_path = env["TAIL_RAY_DB_PATH"]["value"]
    (mount,) = [p for p in mounts if db_path.startswith(p.rstrip("/") + "/")]
    claim_name = volumes[mounts[mount]]["persistentVolumeClaim"]["claimName"]
    (claim,) = [c for c in objects("PersistentVolumeClaim") if c["metadata"]["name"] == claim_name]
    assert claim["spec"]["accessModes"] == ["ReadWriteOncePod"]


def test_service_points_at_the_heads_job_server_and_client_port():
    cluster = ray_cluster()
    name, ns = cluster["metadata"]["name"], cluster["metadata"]["namespace"]
    head_ports = ports_of(cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0])
    env = env_of(service_deployment()["spec"]["template"]["spec"]["containers"][0])
    head_host = f"{name}-head-svc.{ns}.svc.cluster.local"  # KubeRay's head Service name

    ray_address = urlsplit(env["TAIL_RAY_RAY_ADDRESS"]["value"])
    assert ray_address.scheme == "ray", "a pod outside the Ray cluster connects through Ray Client"
    assert (ray_address.hostname, ray_address.port) == (head_host, head_ports["client"])
    dashboard = urlsplit(env["TAIL_RAY_RAY_DASHBOARD_URL"]["value"])
    assert (dashboard.scheme, dashboard.hostname, dashboard.port) == (
        "http",
        head_host,
        head_ports["dashboard"],
    )


def test_service_object_selects_the_app_pods():
    dep, svc = service_deployment(), service_service()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    container_ports = ports_of(dep["spec"]["template"]["spec"]["containers"][0])
    (port,) = svc["spec"]["ports"]
    target = port["targetPort"]
    assert (container_ports[target] if isinstance(target, str) else target) in container_ports.values()


def test_jobs_from_the_service_find_their_code_in_the_image():
    """With TAIL_RAY_JOB_WORKING_DIR empty the service ships no code with a job: its entrypoint's
    relative config path must resolve in the Ray containers' working directory, from the image."""
    from service.schemas import BASE_CONFIG

    env = env_of(service_deployment()["spec"]["template"]["spec"]["containers"][0])
    if env.get("TAIL_RAY_JOB_WORKING_DIR", {}).get("value", "unset") not in ("", "none", "None"):
        return  # the service ships its own checkout as working_dir; nothing to resolve in the image
    assert not Path(BASE_CONFIG).is_absolute()
    copied = {i.args.split()[-1].removeprefix("./") for i in dockerfile("Dockerfile") if i.keyword == "COPY"}
    assert Path(BASE_CONFIG).parts[0] in copied, f"{BASE_CONFIG} is not in a directory the image copies"
    assert (REPO / BASE_CONFIG).is_file()
    assert {pod.main.get("workingDir") for pod in pod_templates() if pod.ray_node} == {"/home/ray/tail-ray"}


# --- storage and pod security ------------------------------------------------------------------


def test_checkpoint_claim_names_its_storage_class():
    """The shared checkpoint claim must not fall back to the cluster's default class, which can
    rarely do ReadWriteMany: the class is an explicit slot the README tells the user to set."""
    (claim,) = [c for c in objects("PersistentVolumeClaim") if "ReadWriteMany" in c["spec"]["accessModes"]]
    slot = claim["spec"].get("storageClassName")
    assert slot, "the ReadWriteMany claim has no storageClassName"
    assert slot in readme(), f"deploy/README.md never tells the user to replace {slot!r}"
    # ... and says what to do when the class is NFS and ignores fsGroup.
    caveat = re.search(r"NFS[^.]*fsGroup|fsGroup[^.]*NFS", readme())
    assert caveat, "deploy/README.md: the NFS fsGroup caveat is missing"


# Pod Security Standards, "restricted" profile (kubernetes.io/docs/concepts/security/pod-security-standards).
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def _restricted_violations(where: str, pod_spec: dict, containers: list[dict]) -> list[str]:
    out = []
    pod_sc = pod_spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            out.append(f"{where}: {flag}")
    for volume in pod_spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"{where}: volume {volume['name']} is {kinds}")
    for container in containers:
        sc = {**pod_sc, **container.get("securityContext", {})}
        name = f"{where} container {container.get('name', '?')}"
        if sc.get("runAsNonRoot") is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        if sc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: no seccompProfile RuntimeDefault")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        caps = container.get("securityContext", {}).get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities {caps['add']}")
    return out


def test_every_pod_meets_pod_security_restricted():
    """Every pod template, and the autoscaler container KubeRay adds to the head pod from
    autoscalerOptions, meets the "restricted" Pod Security profile (seccompProfile RuntimeDefault
    included), so the namespace can enforce it."""
    violations = []
    for pod in pod_templates():
        violations += _restricted_violations(pod.where, pod.spec, pod.containers)
    cluster = ray_cluster()["spec"]
    head_spec = cluster["headGroupSpec"]["template"]["spec"]
    autoscaler = {"name": "autoscaler", **cluster["autoscalerOptions"]}
    violations += _restricted_violations("RayCluster head", {**head_spec, "volumes": []}, [autoscaler])
    assert not violations, violations
    (ns,) = objects("Namespace")
    labels = ns["metadata"]["labels"]
    assert labels.get("pod-security.kubernetes.io/warn") == "restricted"
    assert labels.get("pod-security.kubernetes.io/enforce") in ("baseline", "restricted")
