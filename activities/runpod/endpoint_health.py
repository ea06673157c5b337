"""The health watch of a RunPod endpoint, run for its pool's dispatcher.

One watch per bounded runpod pool, on a shared cadence (not a `/health` call per job): the
activity reads the endpoint's `GET /health` every `CHECK_EVERY_S`, heartbeats, and returns
only when what it means for routing changes, so the dispatcher's history grows by one activity
per change:

- **unhealthy**: no worker can take a new job (none idle or starting) while some are
  unhealthy or throttled; or `/health` itself failed `FAILS_TO_MARK` times in a row (RunPod's
  API is where jobs are submitted too). Its queue grants nothing meanwhile, and a job of a group
  moves on to the group's next pool.
- **cold**: no worker idle or running (none at all, or some starting): a job waits for a cold
  start, which its wait estimate counts (`cold_start_s`).

It also returns after `WATCH_FOR_S` with what it read, so the pool's changed settings reach the
next watch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import UTC, datetime

import structlog
from temporalio import activity

from activities.runpod.client import RunPodClient
from activities.runpod.models import RunPodHealth
from workflows.admission import EndpointHealth
from workflows.errors import RunPodError
from workflows.shared import ACTIVITY_WATCH_ENDPOINT

log = structlog.get_logger(__name__)

CHECK_EVERY_S = 2.0
CHECK_TIMEOUT_S = 10.0
FAILS_TO_MARK = 3
WATCH_FOR_S = 600.0


def read_health(health: RunPodHealth, now: datetime) -> EndpointHealth:
    """What `/health`'s counts mean for routing."""
    workers, jobs = health.workers, health.jobs
    stuck = workers.unhealthy + workers.throttled
    unhealthy = None
    # `ready` is left out: RunPod does not define it, and it counts running workers too (the
    # simulator's reading), which take no new job until theirs ends.
    if stuck and not (workers.idle or workers.initializing):
        unhealthy = (
            f"no worker can take a job: {workers.unhealthy} unhealthy, "
            f"{workers.throttled} throttled, {workers.running} running"
        )
    return EndpointHealth(
        idle=workers.idle,
        initializing=workers.initializing,
        ready=workers.ready,
        running=workers.running,
        throttled=workers.throttled,
        unhealthy_workers=workers.unhealthy,
        in_queue=jobs.in_queue,
        in_progress=jobs.in_progress,
        unhealthy=unhealthy,
        # No worker up at all: a new job waits for one to start (from zero, or a starting one).
        cold=unhealthy is None and not (workers.idle or workers.running),
        as_of=now,
    )


class EndpointHealthActivities:
    def __init__(
        self, clients: Mapping[str, RunPodClient], *, check_every_s: float = CHECK_EVERY_S
    ) -> None:
        self._clients = clients
        self._every_s = check_every_s

    @activity.defn(name=ACTIVITY_WATCH_ENDPOINT)
    async def watch_endpoint_health(
        self, pool: str, known: EndpointHealth | None
    ) -> EndpointHealth:
        """The endpoint's health once it means something else for routing than `known`
        (None: nothing known yet, so the first read), or after `WATCH_FOR_S`."""
        client = self._clients.get(pool)
        if client is None:
            # Not a runpod pool of this worker: say nothing changed, and let another look.
            await asyncio.sleep(self._every_s)
            return known or EndpointHealth(as_of=datetime.now(UTC))
        failures = 0
        until = time.monotonic() + WATCH_FOR_S
        seen = known
        while True:
            now = datetime.now(UTC)
            try:
                async with asyncio.timeout(CHECK_TIMEOUT_S):
                    seen = read_health(await client.health(), now)
                failures = 0
            except (RunPodError, TimeoutError) as exc:
                failures += 1
                if failures >= FAILS_TO_MARK:
                    seen = EndpointHealth(unhealthy=f"GET /health failed: {exc}", as_of=now)
            if seen is not None and (not seen.same_as(known) or time.monotonic() >= until):
                if not seen.same_as(known):
                    log.warning(
                        "pool_endpoint_health",
                        pool=pool,
                        unhealthy=seen.unhealthy,
                        cold=seen.cold,
                        idle=seen.idle,
                        initializing=seen.initializing,
                        unhealthy_workers=seen.unhealthy_workers,
                        throttled=seen.throttled,
                    )
                return seen
            activity.heartbeat()
            await asyncio.sleep(self._every_s)
