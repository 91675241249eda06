"""Prometheus scrapes what the manifests expose, and the Grafana dashboard asks for metrics that
the service and Ray really export."""

from __future__ import annotations

import json
import re
from importlib import resources

import yaml
from deploy_support import (
    DEPLOY,
    env_of,
    objects,
    ports_of,
    ray_cluster,
    readme,
    service_deployment,
    service_metric_names,
)

PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
RULES = DEPLOY / "prometheus" / "tail-ray-rules.yml"
PROMETHEUS_RULE = DEPLOY / "prometheus" / "prometheusrule.yaml"
DASHBOARD = DEPLOY / "grafana" / "tail-ray-dashboard.json"

# The service's Prometheus names as its source spelled them when this was written. Used only when
# the service's source in this checkout defines none (before the service branch is merged);
# otherwise the names are read from service/*.py. Keep this list here and nowhere else.
FALLBACK_SERVICE_METRICS = frozenset(
    {
        "tail_ray_ingest_up",
        "tail_ray_jobs",
        "tail_ray_job_raw_bytes_total",
        "tail_ray_job_sent_bytes_total",
        "tail_ray_job_ratio",
        "tail_ray_job_steps",
        "tail_ray_job_ingested_records_total",
        "tail_ray_job_missed_records_total",
        "tail_ray_layer_ratio",
        "tail_ray_layer_bits",
    }
)

# PromQL keywords that can stand without parentheses (functions are told apart by their "(").
PROMQL_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "on", "ignoring", "by", "without"})


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label names, functions and strings removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group(0)
        follows = text[match.end() :].lstrip()
        if word in PROMQL_KEYWORDS or follows.startswith("("):
            continue
        names.add(word)
    return names


def test_metric_names_parser():
    assert metric_names('sum by (job_id) (rate(a_total{job_id=~"$j", x="y(z)"}[5m]))') == {"a_total"}
    assert metric_names("sum(a) - sum(b{l='1'})") == {"a", "b"}
    assert metric_names("label_values(tail_ray_job_steps, job_id)") == {"tail_ray_job_steps", "job_id"}


# --- Prometheus --------------------------------------------------------------------------------


def _scrape_jobs() -> dict[str, dict]:
    config = yaml.safe_load(PROMETHEUS.read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_prometheus_scrapes_the_service_even_while_it_is_not_ready():
    """Readiness is /readyz, false while Ray is down, and a ClusterIP Service drops a pod that
    is not ready. Prometheus therefore scrapes through a headless Service that publishes
    not-ready pods: else "cannot reach Ray" would read as "service down", and
    tail_ray_ingest_up == 0 would never be scraped to alert on."""
    job = _scrape_jobs()["tail-ray-service"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    (target,) = targets
    host, _, port = target.rpartition(":")
    services = {
        f"{s['metadata']['name']}.{s['metadata']['namespace']}.svc.cluster.local": s
        for s in objects("Service")
    }
    assert host in services, f"{host} is no Service of deploy/k8s"
    svc = services[host]
    assert svc["spec"].get("publishNotReadyAddresses") is True, f"{host} hides the pod while it is not ready"
    assert svc["spec"].get("clusterIP") == "None", "headless: the name resolves to the pod itself"
    # It selects the control plane's pods, on the port the app listens on.
    dep = service_deployment()
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    target_port = svc_port["targetPort"]
    resolved = ports_of(container)[target_port] if isinstance(target_port, str) else target_port
    assert resolved == ports_of(container)["http"], "the metrics Service must reach the app's port"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_prometheus_discovers_every_ray_metrics_port():
    job = _scrape_jobs()["ray-nodes"]
    cluster = ray_cluster()
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod"
    assert sd["namespaces"]["names"] == [cluster["metadata"]["namespace"]]
    rules = job["relabel_configs"]
    keep = {tuple(r["source_labels"]): r["regex"] for r in rules if r.get("action") == "keep"}
    # Prometheus anchors relabel regexes: fullmatch is the right test.
    assert re.fullmatch(keep[("__meta_kubernetes_pod_label_ray_io_cluster",)], cluster["metadata"]["name"])
    port_regex = keep[("__meta_kubernetes_pod_container_port_name",)]
    spec = cluster["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        ports = ports_of(group["template"]["spec"]["containers"][0])
        metrics_port = int(group["rayStartParams"]["metrics-export-port"])
        scraped = {p for n, p in ports.items() if re.fullmatch(port_regex, n)}
        assert metrics_port in scraped, f"{group.get('groupName', 'head')}: {metrics_port} not scraped"
        # Only metrics ports: never the GCS, the job server or the client port.
        assert not scraped & {6379, 8265, 10001}
    head_ports = ports_of(spec["headGroupSpec"]["template"]["spec"]["containers"][0])
    # Ray's autoscaler and dashboard export on fixed ports on the head (ray constants).
    from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    for port in (AUTOSCALER_METRIC_PORT, DASHBOARD_METRIC_PORT):
        (name,) = [n for n, p in head_ports.items() if p == port]
        assert re.fullmatch(port_regex, name)


# --- Grafana -----------------------------------------------------------------------------------


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]


def _service_names() -> set[str]:
    """The service's metric names, with the suffixes Prometheus text puts on counters."""
    names = service_metric_names() or set(FALLBACK_SERVICE_METRICS)
    return names | {n.removesuffix("_total") for n in names if n.endswith("_total")}


def _exported(name: str, exported: set[str]) -> bool:
    return name in exported or any(e.endswith("*") and name.startswith(e[:-1]) for e in exported)


def test_dashboard_asks_only_for_metrics_the_service_exports():
    exported = _service_names()
    asked = {n for expr in _exprs() for n in metric_names(expr) if n.startswith("tail_ray_")}
    variable_queries = [v["definition"] for v in _dashboard()["templating"]["list"] if v["type"] == "query"]
    asked |= {n for q in variable_queries for n in metric_names(q) if n.startswith("tail_ray_")}
    assert len(asked) >= 6, asked
    missing = sorted(n for n in asked if not _exported(n, exported))
    assert not missing, (
        f"the dashboard queries {missing}, which the service does not export ({sorted(exported)})"
    )


def test_dashboard_ray_metrics_exist_in_ray():
    """ray_* names come from each node's metrics agent, autoscaler_* from the autoscaler."""
    reporter = (resources.files("ray") / "dashboard/modules/reporter/reporter_agent.py").read_text()
    autoscaler = (resources.files("ray") / "autoscaler/_private/prom_metrics.py").read_text()
    asked = {n for expr in _exprs() for n in metric_names(expr) if not n.startswith("tail_ray_")}
    assert asked, "the dashboard should show the Ray cluster too"
    for name in asked:
        if name.startswith("autoscaler_"):
            assert f'"{name.removeprefix("autoscaler_")}"' in autoscaler, name
        else:
            assert name.startswith("ray_") and f'"{name.removeprefix("ray_")}"' in reporter, name


def test_dashboard_has_per_layer_ratio_and_traffic_panels():
    panels = _panels()
    per_layer = [
        p
        for p in panels
        if any(
            "tail_ray_layer_ratio" in t["expr"] and "{{layer}}" in t.get("legendFormat", "")
            for t in p["targets"]
        )
    ]
    assert per_layer, "no panel shows the compression ratio per layer"
    traffic = [
        p
        for p in panels
        if {"tail_ray_job_raw_bytes_total", "tail_ray_job_sent_bytes_total"}
        <= {n for t in p["targets"] for n in metric_names(t["expr"])}
    ]
    assert traffic, "no panel shows raw vs sent traffic"


def test_dashboard_is_well_formed():
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in variables or var.startswith("__"), f"{panel['title']}: unknown ${var}"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24


# --- alert rules -------------------------------------------------------------------------------


def test_alert_rules_load_and_use_exported_metrics():
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = _scrape_jobs()
    rule_files = [PROMETHEUS.parent / name for name in config["rule_files"]]
    assert rule_files
    exported = _service_names()
    rules = [
        rule
        for path in rule_files
        for group in yaml.safe_load(path.read_text())["groups"]
        for rule in group["rules"]
    ]
    assert rules
    for rule in rules:
        assert rule["alert"] and rule["annotations"]["summary"], rule
        names = metric_names(rule["expr"])
        assert names, rule["expr"]
        for name in names:
            assert name == "up" or _exported(name, exported), f"{rule['alert']}: {name} is not exported"
        # `job` matchers name real scrape jobs (a renamed job silently disables an alert).
        for job in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert job in jobs, f"{rule['alert']}: no scrape job {job!r}"


def test_prometheus_can_read_metrics_when_reads_need_the_token():
    """A service reached beyond loopback (the Deployment serves on 0.0.0.0) guards /metrics too
    unless TAIL_RAY_READ_REQUIRES_TOKEN=false; the scrape job must then send the API token."""
    env = env_of(service_deployment()["spec"]["template"]["spec"]["containers"][0])
    setting = str(env.get("TAIL_RAY_READ_REQUIRES_TOKEN", {}).get("value", "")).lower()
    guarded = setting not in ("0", "false")
    job = _scrape_jobs()["tail-ray-service"]
    assert not guarded or "authorization" in job or "bearer_token_file" in job


def test_prometheus_rule_carries_the_alerts_and_a_release_label():
    """The PrometheusRule for kube-prometheus-stack holds exactly the alerts of the rules file, and
    the `release` label its default ruleSelector matches on; the README says how to set it."""
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    assert rule["metadata"]["labels"].get("release"), "kube-prometheus-stack ignores rules without it"
    assert re.search(r"kubectl label --local[^\n]*release=", readme()), "README: how to set the release label"
