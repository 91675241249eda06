"""Prometheus exposition of the service's figures: a prometheus_client collector over storage.

The library owns the format (types, escaping, the ``_total`` suffix, OpenMetrics when the
scraper's Accept header asks for it); this module only says what to expose. Each scrape reads
storage afresh, in a registry of its own (no process-global state, one per app).

Label cardinality is bounded: job series only for the newest ``prometheus_max_jobs`` jobs,
layer series only for up to ``prometheus_max_layers`` layers of each of those jobs.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from service.settings import Settings
from service.storage import Storage

# (name, counter?, help, key in storage.summary()) of the per-job families.
_JOB_FAMILIES = (
    ("tail_ray_job_raw_bytes_total", True, "Uncompressed gradient bytes, summed over ranks.", "raw_bytes"),
    ("tail_ray_job_sent_bytes_total", True, "Bytes sent on the wire, summed over ranks.", "bytes_sent"),
    ("tail_ray_job_ratio", False, "Raw bytes / bytes sent over the whole job.", "ratio"),
    ("tail_ray_job_steps", False, "Steps with metrics ingested.", "steps"),
)
_INGEST_FAMILIES = (
    ("tail_ray_job_ingested_records_total", "Metric records stored for the job.", "records"),
    ("tail_ray_job_missed_records_total", "Records the sink dropped before ingest.", "missed"),
)
_LAYER_FAMILIES = (
    ("tail_ray_layer_ratio", "Newest compression ratio per layer (raw / encoded).", "ratio"),
    ("tail_ray_layer_bits", "Newest bit width per layer (mean over ranks).", "bits"),
)


class StorageCollector:
    """Reads storage on every ``collect`` (a scrape) and yields the metric families."""

    def __init__(
        self, storage: Storage, settings: Settings, ingest_ok: bool, leader: bool, stored_here: int
    ) -> None:
        self.storage, self.settings, self.ingest_ok = storage, settings, ingest_ok
        self.leader, self.stored_here = leader, stored_here

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("tail_ray_ingest_up", "1 when the last ingest pass reached Ray.")
        up.add_metric([], 1.0 if self.ingest_ok else 0.0)
        yield up
        leader = GaugeMetricFamily(
            "tail_ray_ingest_leader", "1 on the replica that holds the ingester lease."
        )
        leader.add_metric([], 1.0 if self.leader else 0.0)
        yield leader
        yield CounterMetricFamily(
            "tail_ray_ingest_stored_records_total",
            "Metric records this replica stored.",
            value=self.stored_here,
        )
        yield from self._storage_size()
        jobs_by_status = GaugeMetricFamily(
            "tail_ray_jobs", "Jobs known to the service, by status.", labels=["status"]
        )
        for status, count in sorted(self.storage.status_counts().items()):
            jobs_by_status.add_metric([status], count)
        yield jobs_by_status

        jobs, _ = self.storage.list_jobs(self.settings.prometheus_max_jobs, 0)
        summaries = [(job.id, self.storage.summary(job.id)) for job in jobs]
        for name, counter, help_text, key in _JOB_FAMILIES:
            family = _family(name, counter, help_text, ["job_id"])
            for job_id, summary in summaries:
                family.add_metric([job_id], summary[key])
            yield family
        for name, help_text, key in _INGEST_FAMILIES:
            family = _family(name, True, help_text, ["job_id"])
            for job_id, summary in summaries:
                family.add_metric([job_id], summary["ingest"][key])
            yield family

        max_layers = self.settings.prometheus_max_layers
        layer_rows = [(job.id, self.storage.latest_layers(job.id)[:max_layers]) for job in jobs]
        for name, help_text, key in _LAYER_FAMILIES:
            family = GaugeMetricFamily(name, help_text, labels=["job_id", "layer"])
            for job_id, rows in layer_rows:
                for row in rows:
                    family.add_metric([job_id, row["layer"]], row[key])
            yield family

    def _storage_size(self) -> Iterator[Metric]:
        size = self.storage.size()
        records = GaugeMetricFamily(
            "tail_ray_storage_records", "Metric records kept in the database, by kind.", labels=["kind"]
        )
        records.add_metric(["layer"], size.layer_records)
        records.add_metric(["step"], size.step_records)
        yield records
        yield CounterMetricFamily(
            "tail_ray_storage_pruned_records_total",
            "Metric records thinned out by retention.",
            value=size.pruned_records,
        )
        yield GaugeMetricFamily(
            "tail_ray_storage_bytes",
            f"Database size ({self.storage.backend}), bytes.",
            value=size.database_bytes,
        )


def _family(
    name: str, counter: bool, help_text: str, labels: list[str]
) -> CounterMetricFamily | GaugeMetricFamily:
    if counter:
        return CounterMetricFamily(name, help_text, labels=labels)
    return GaugeMetricFamily(name, help_text, labels=labels)


def render_prometheus(
    storage: Storage,
    settings: Settings,
    ingest_ok: bool,
    accept: str | None = None,
    leader: bool = True,
    stored_here: int = 0,
) -> tuple[bytes, str]:
    """(body, content type) of one scrape: Prometheus text 0.0.4, or OpenMetrics text when
    ``accept`` (the request's Accept header) asks for ``application/openmetrics-text``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StorageCollector(storage, settings, ingest_ok, leader, stored_here))
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
