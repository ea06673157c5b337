"""The aiohttp application: the public API, the worker API, /sim/, and the background timers;
on shutdown every worker is stopped (SIGTERM, then SIGKILL to its process group)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from . import routes_public, routes_sim, routes_worker
from .runtime import RUNTIME, build_runtime
from .settings import MB, SIM_VERSION, SimSettings

log = structlog.get_logger("runpod_sim.server")


async def _background(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    timers = asyncio.create_task(rt.platform.run_timers(), name="runpod-sim-timers")
    log.info(
        "RunPod simulator ready",
        version=SIM_VERSION,
        endpoint_id=rt.settings.endpoint_id,
        clock_speed=rt.clock.speed,
        work_dir=str(rt.work_dir),
    )
    yield
    timers.cancel()
    await asyncio.gather(timers, return_exceptions=True)
    await rt.webhooks.close()


async def _stop_workers(app: web.Application) -> None:
    # on_shutdown runs while connections are still open: the workers' long-polls answer at once
    # and the SDK's loops wind down before their processes are signalled.
    await app[RUNTIME].platform.shutdown()


def create_app(settings: SimSettings | None = None) -> web.Application:
    """The simulator as an aiohttp Application (for in-process use or web.run_app)."""
    settings = settings or SimSettings()
    biggest = max(settings.max_runsync_body_mb, settings.max_run_body_mb, settings.max_result_mb)
    # Room above the biggest limit, so an oversized body reaches our own checks (and their
    # answers) rather than aiohttp's generic 413.
    app = web.Application(client_max_size=round(biggest * MB * 2))
    app[RUNTIME] = build_runtime(settings)
    app.add_routes(routes_public.routes)
    app.add_routes(routes_worker.routes)
    app.add_routes(routes_sim.routes)
    app.cleanup_ctx.append(_background)
    app.on_shutdown.append(_stop_workers)
    return app
