"""The simulator's moving parts, wired together once per aiohttp application."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from .clock import SimClock
from .env_factories import build_factories
from .faults import FaultState
from .jobs import JobTable
from .platform import Platform
from .ratelimit import RateLimiter
from .settings import SimSettings
from .webhooks import Webhooks
from .workers import WorkerPool


@dataclass
class SimRuntime:
    settings: SimSettings
    clock: SimClock
    table: JobTable
    pool: WorkerPool
    faults: FaultState
    platform: Platform
    limiter: RateLimiter
    webhooks: Webhooks
    work_dir: Path


RUNTIME = web.AppKey("runpod_sim_runtime", SimRuntime)


def build_runtime(settings: SimSettings) -> SimRuntime:
    clock = SimClock(settings.clock_speed)
    work_dir = settings.work_dir or Path(tempfile.mkdtemp(prefix="runpod-sim-"))
    work_dir = work_dir.expanduser().resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    table = JobTable(settings, clock)
    faults = FaultState()
    holder: list[Platform] = []
    pool = WorkerPool(
        settings,
        clock,
        build_factories(settings),
        work_dir,
        table.changes,
        on_exit=lambda worker: holder[0].on_worker_exit(worker),
    )
    platform = Platform(settings, clock, table, pool, faults)
    holder.append(platform)
    webhooks = Webhooks(clock)
    table.on_terminal.append(webhooks.job_ended)
    return SimRuntime(
        settings=settings,
        clock=clock,
        table=table,
        pool=pool,
        faults=faults,
        platform=platform,
        limiter=RateLimiter(settings.rate_limits),
        webhooks=webhooks,
        work_dir=work_dir,
    )


def runtime_of(request: web.Request) -> SimRuntime:
    return request.app[RUNTIME]
