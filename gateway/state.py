"""What one gateway process holds: its keys and limits, its one `JobClient`, its followers.

Nothing here is job state: the jobs live in Temporal. The client connects in the background
and keeps trying, so a gateway started before Temporal (or cut from it) serves `/healthz`,
answers `/readyz` 503 and every job route 503 `TemporalUnavailable` until it connects.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

import structlog
from fastapi import Request

from configuration.settings import GatewaySettings
from gateway.auth import ApiKeys
from gateway.feed import Hub
from gateway.limits import Limits
from gateway.views import JobFacts, JobViews
from starter.client import JobClient
from starter.errors import TemporalUnreachable

log = structlog.get_logger("gateway")

ClientFactory = Callable[[], Awaitable[JobClient]]
# Backoff between connection attempts: jittered, at most this long.
CONNECT_RETRY_MAX_S = 10.0


class ContactThrottle:
    """When a GET last counted as a job's client contact (per job, in this process)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def due(self, job_id: str, abandon_after_s: float | None) -> bool:
        """True (and noted) when a `client_seen` is due: at most every `interval_s`, and at
        least four times per abandonment horizon, so a polling client keeps its job."""
        interval = self.interval_s
        if abandon_after_s is not None:
            interval = min(interval, abandon_after_s / 4)
        now = time.monotonic()
        if now - self._last.get(job_id, float("-inf")) < interval:
            return False
        self._last[job_id] = now
        if len(self._last) > 10_000:
            # Forget the jobs polled longest ago: the worst a forgotten job gets is one more.
            for stale in sorted(self._last, key=self._last.__getitem__)[:1000]:
                del self._last[stale]
        return True


class Gateway:
    def __init__(
        self, settings: GatewaySettings, client_factory: ClientFactory, keys: ApiKeys
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.limits = Limits.from_settings(settings, keys.limits)
        self.facts = JobFacts()
        self.contact = ContactThrottle(settings.client_seen_interval_s)
        self._factory = client_factory
        self._client: JobClient | None = None
        self._hub: Hub | None = None
        self._connecting: asyncio.Task[None] | None = None

    # -- the client ---------------------------------------------------------------------------

    def start(self) -> None:
        self._connecting = asyncio.create_task(self._connect(), name="gateway connect")

    async def _connect(self) -> None:
        attempt = 0
        while True:
            try:
                client = await self._factory()
            except Exception as exc:
                delay = min(CONNECT_RETRY_MAX_S, 0.5 * 2**attempt) * random.uniform(0.5, 1)
                attempt += 1
                log.warning(
                    "temporal_unreachable", error=str(exc)[:300], retry_in_s=round(delay, 1)
                )
                await asyncio.sleep(delay)
                continue
            self._client = client
            views = JobViews(client, self.facts, self.settings.base_path)
            self._hub = Hub(
                self.client,
                views,
                grace_s=self.settings.follower_grace_s,
                poll_interval_s=self.settings.poll_interval_s,
                queue_size=self.settings.subscriber_queue,
            )
            log.info("temporal_connected", target=client.temporal.service_client.config.target_host)
            return

    async def client(self) -> JobClient:
        if self._client is None:
            raise TemporalUnreachable("Temporal", "not connected yet")
        return self._client

    @property
    def hub(self) -> Hub:
        if self._hub is None:
            raise TemporalUnreachable("Temporal", "not connected yet")
        return self._hub

    @property
    def views(self) -> JobViews:
        return self.hub.views

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        if self._hub is not None:
            await self._hub.close()
        if self._client is not None:
            await self._client.close()


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway
