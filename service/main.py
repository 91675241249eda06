"""The FastAPI app: wiring only. Run with `uvicorn --factory service.main:create_app`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from service.errors import install_error_handlers
from service.exposure import HostAllowList
from service.ingest_process import IngestProcess
from service.ingester import Ingester
from service.limits import BodySizeLimit
from service.live import LiveMetrics
from service.packages import Limits, PackageStore
from service.ray_client import RayGateway
from service.read_cache import ReadCache
from service.routers import health, jobs, metrics, packages
from service.settings import Settings
from service.storage import open_storage

logger = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).parent / "static"
GIL_SWITCH_INTERVAL_S = 0.001


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()  # type: ignore[call-arg]  # fields come from the environment

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The ingester's thread runs pure Python (decoding and converting sink pages) for tens of
        # milliseconds at a time; a request waits for the interpreter lock at every hop between
        # the event loop and a worker thread, up to the switch interval each time. At CPython's
        # 5 ms, a three-hop read's p99 went from 4-14 ms to 35-67 ms beside a busy ingest thread;
        # at 1 ms, to 5-20 ms (python -m jobs.bench_switch_interval, docs/operations.md).
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # Opening migrates: blocking work, so off the event loop.
        app.state.storage = storage = await asyncio.to_thread(open_storage, settings.storage_url)
        logger.info("storage: %s", storage.describe())
        app.state.packages = PackageStore(
            settings.package_root(),
            Limits(
                settings.package_max_bytes, settings.package_max_unpacked_bytes, settings.package_max_files
            ),
        )
        # Results keyed by each job's ingest state, or young enough (read_cache.py).
        app.state.read_cache = ReadCache(max_age_s=settings.read_max_staleness_s)
        app.state.ray = RayGateway(settings)
        app.state.ingester = Ingester(settings, storage, app.state.ray)
        app.state.live = LiveMetrics(storage, app.state.read_cache, settings)
        app.state.ingest_status = app.state.ingester.status
        stop = asyncio.Event()
        task = None
        if settings.ingest_enabled and settings.ingest_in_process:
            task = asyncio.create_task(app.state.ingester.run_forever(stop))
        elif settings.ingest_enabled:  # its own process: reads never wait for its interpreter lock
            child = IngestProcess(settings)
            app.state.ingest_status = lambda: child.status
            task = asyncio.create_task(child.run_forever(stop))
        try:
            yield
        finally:
            stop.set()
            await app.state.live.close()
            if task is not None:
                await task
            await asyncio.to_thread(app.state.read_cache.close)  # a refresh reads the storage
            app.state.ingester.close()
            await asyncio.to_thread(storage.close)

    app = FastAPI(
        title="tail-ray",
        version="0.1.0",
        summary="Submit Tail-compressed training jobs to Ray and watch per-layer compression live.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_body_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
        path_limits={packages.UPLOAD_PATH: settings.package_max_bytes},
    )
    app.add_middleware(HostAllowList, allowed_hosts=settings.allowed_hosts)  # outermost: checked first
    app.include_router(jobs.router)
    app.include_router(packages.router)
    app.include_router(metrics.router)
    app.include_router(metrics.prometheus_router)
    app.include_router(health.router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    return app
