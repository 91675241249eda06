"""The REST API's routers, one module per resource: health, jobs, metrics, packages."""
