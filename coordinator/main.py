"""Builds the FastAPI app: settings, Redis, the Celery client and the watchdog live for the app's lifetime."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, status
from fastapi.exceptions import RequestValidationError
from redis import Redis
from redis.exceptions import RedisError

from coordinator.api.errors import error_handler, invalid_request
from coordinator.api.routes import health, jobs, metrics, status_page, streams, workers
from coordinator.config import CoordinatorSettings
from coordinator.dispatch import Dispatcher, reaper_loop
from coordinator.metrics import StateCollector, build_registry
from layertap import __version__
from layertap.diskspace import DiskSpaceError
from layertap.errors import DatasetError, SpecError, StoreError
from layertap.state.keys import Keys

log = logging.getLogger("coordinator")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings = CoordinatorSettings()
    app.state.settings = settings
    app.state.redis = Redis.from_url(settings.redis_url, decode_responses=True)
    app.state.keys = Keys(settings.key_prefix)
    app.state.dispatcher = Dispatcher(settings.broker_url)
    app.state.metrics_registry = build_registry(
        StateCollector(app.state.redis, app.state.keys, app.state.dispatcher, settings)
    )
    if settings.api_open:
        log.warning("LAYERTAP_API_OPEN is set: the API is open to anyone who can reach it")
    reaper = asyncio.create_task(reaper_loop(app.state.redis, app.state.keys, app.state.dispatcher, settings))
    try:
        yield
    finally:
        reaper.cancel()
        with suppress(asyncio.CancelledError):
            await reaper
        app.state.dispatcher.close()
        app.state.redis.close()


app = FastAPI(
    title="layertap coordinator",
    version=__version__,
    description="Distributed hidden-state extraction: submit a job, follow its shards, cancel or resume it.",
    lifespan=lifespan,
)
# Errors named by who acts, mapped once: the user's spec or dataset (422), an output folder that
# belongs to another run or job (409), the state store being unreachable (503: try again).
app.add_exception_handler(RequestValidationError, invalid_request)
app.add_exception_handler(SpecError, error_handler(status.HTTP_422_UNPROCESSABLE_CONTENT))
app.add_exception_handler(DatasetError, error_handler(status.HTTP_422_UNPROCESSABLE_CONTENT))
app.add_exception_handler(StoreError, error_handler(status.HTTP_409_CONFLICT))
app.add_exception_handler(DiskSpaceError, error_handler(status.HTTP_507_INSUFFICIENT_STORAGE))
app.add_exception_handler(RedisError, error_handler(status.HTTP_503_SERVICE_UNAVAILABLE))  # Redis restarting
app.include_router(health.router)
app.include_router(jobs.router)
app.include_router(workers.router)
app.include_router(streams.router)
app.include_router(metrics.router)
app.include_router(status_page.router)
