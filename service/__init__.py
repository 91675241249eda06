"""The control plane: a FastAPI service (jobs, metrics ingest, SSE, Prometheus, dashboard) and the CLI."""
