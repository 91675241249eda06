"""Prometheus text exposition, written by hand (a dozen series do not need a client library).

Label cardinality is bounded: job series only for the newest ``prometheus_max_jobs`` jobs,
layer series only for up to ``prometheus_max_layers`` layers of each of those jobs.
"""

from __future__ import annotations

from service.settings import Settings
from service.storage import Storage


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        if labels:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{text}}} {float(value)!r}")
        else:
            self.lines.append(f"{name} {float(value)!r}")


def render_prometheus(
    storage: Storage, settings: Settings, ingest_ok: bool, leader: bool = True, stored_here: int = 0
) -> str:
    w = _Writer()
    w.family("tail_ray_ingest_up", "gauge", "1 when the last ingest pass reached Ray.")
    w.sample("tail_ray_ingest_up", 1.0 if ingest_ok else 0.0)
    w.family("tail_ray_ingest_leader", "gauge", "1 on the replica that holds the ingester lease.")
    w.sample("tail_ray_ingest_leader", 1.0 if leader else 0.0)
    w.family("tail_ray_ingest_stored_records_total", "counter", "Metric records this replica stored.")
    w.sample("tail_ray_ingest_stored_records_total", stored_here)

    size = storage.size()
    w.family("tail_ray_storage_records", "gauge", "Metric records kept in the database, by kind.")
    w.sample("tail_ray_storage_records", size.layer_records, kind="layer")
    w.sample("tail_ray_storage_records", size.step_records, kind="step")
    w.family("tail_ray_storage_pruned_records_total", "counter", "Metric records thinned out by retention.")
    w.sample("tail_ray_storage_pruned_records_total", size.pruned_records)
    w.family("tail_ray_storage_bytes", "gauge", f"Database size ({storage.backend}), bytes.")
    w.sample("tail_ray_storage_bytes", size.database_bytes)

    w.family("tail_ray_jobs", "gauge", "Jobs known to the service, by status.")
    for status, count in sorted(storage.status_counts().items()):
        w.sample("tail_ray_jobs", count, status=status)

    jobs, _ = storage.list_jobs(settings.prometheus_max_jobs, 0)
    summaries = [(job, storage.summary(job.id)) for job in jobs]
    families = (
        (
            "tail_ray_job_raw_bytes_total",
            "counter",
            "Uncompressed gradient bytes, summed over ranks.",
            "raw_bytes",
        ),
        (
            "tail_ray_job_sent_bytes_total",
            "counter",
            "Bytes sent on the wire, summed over ranks.",
            "bytes_sent",
        ),
        ("tail_ray_job_ratio", "gauge", "Raw bytes / bytes sent over the whole job.", "ratio"),
        ("tail_ray_job_steps", "gauge", "Steps with metrics ingested.", "steps"),
    )
    for name, kind, help_text, key in families:
        w.family(name, kind, help_text)
        for job, summary in summaries:
            w.sample(name, summary[key], job_id=job.id)
    w.family("tail_ray_job_ingested_records_total", "counter", "Metric records stored for the job.")
    for job, summary in summaries:
        w.sample("tail_ray_job_ingested_records_total", summary["ingest"]["records"], job_id=job.id)
    w.family("tail_ray_job_missed_records_total", "counter", "Records the sink dropped before ingest.")
    for job, summary in summaries:
        w.sample("tail_ray_job_missed_records_total", summary["ingest"]["missed"], job_id=job.id)

    layer_rows = [(job, storage.latest_layers(job.id)[: settings.prometheus_max_layers]) for job in jobs]
    w.family("tail_ray_layer_ratio", "gauge", "Newest compression ratio per layer (raw / encoded).")
    for job, rows in layer_rows:
        for row in rows:
            w.sample("tail_ray_layer_ratio", row["ratio"], job_id=job.id, layer=row["layer"])
    w.family("tail_ray_layer_bits", "gauge", "Newest bit width per layer (mean over ranks).")
    for job, rows in layer_rows:
        for row in rows:
            w.sample("tail_ray_layer_bits", row["bits"], job_id=job.id, layer=row["layer"])
    return "\n".join(w.lines) + "\n"
