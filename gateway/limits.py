"""How much a tenant, and the gateway as a whole, may ask (docs/http-api.md, Errors: 429, 503).

    per tenant   requests per second: a token bucket (DURABLE_COMFY_TENANT_RPS, refilled at that
                 rate, up to DURABLE_COMFY_TENANT_BURST) -> RateLimited, Retry-After the time
                 until the next token;
                 jobs in flight: DURABLE_COMFY_TENANT_MAX_JOBS (2000), counted in Temporal's
                 visibility (the tenant's open jobs of every pool, not yet ended, PENDING ones
                 included) -> TooManyJobs
    the gateway  requests at once (DURABLE_COMFY_GATEWAY_MAX_REQUESTS) and open SSE/WebSocket
                 streams (DURABLE_COMFY_GATEWAY_MAX_STREAMS) -> Overloaded

The buckets and the counters live in each replica: behind a load balancer spreading a tenant
over N replicas, the tenant gets up to N times its rate, and the gateway N times its
concurrency. Jobs in flight are counted from Temporal, so that limit holds across replicas,
as far as visibility is up to date: it lags the jobs by up to a second or so (Elasticsearch
more than SQL), and two submissions counted at the same moment may both be let in. It is a
brake on runaway clients, not an exact quota.

Not to be confused with a bounded pool's `QueueFull` (gateway.errors): the pool's queue itself
refuses a job above the workers' `max_pending` (the tenant's or the pool's), at submission.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import structlog

from gateway.auth import TenantLimits, check_tenant
from gateway.errors import Overloaded, RateLimited, TooManyJobs
from starter.client import JobClient
from workflows.contracts import TERMINAL_STATES
from workflows.shared import SA_JOB_STATE, SA_TENANT, WORKFLOW_TYPE

log = structlog.get_logger("gateway.limits")

# How long a tenant at its jobs-in-flight limit is asked to wait: jobs run for seconds to
# minutes, so sooner would only be refused again.
JOBS_RETRY_AFTER_S = 5
# A full gateway frees a slot as soon as any request ends.
OVERLOADED_RETRY_AFTER_S = 1


class LimitSources(Protocol):
    """What `Limits.from_settings` reads: configuration.settings' `LimitSettings`, or a settings
    class embedding it (`GatewaySettings`)."""

    @property
    def tenant_rps(self) -> float: ...

    @property
    def tenant_burst(self) -> int: ...

    @property
    def tenant_max_jobs(self) -> int: ...

    @property
    def gateway_max_requests(self) -> int: ...

    @property
    def gateway_max_streams(self) -> int: ...


def jobs_in_flight_query(tenant: str) -> str:
    """The tenant's jobs that have not ended. A job's workflow may stay open after its end
    (delivering its webhooks): its JobState is terminal by then, so it does not count."""
    ended = ", ".join(f'"{state.value}"' for state in sorted(TERMINAL_STATES))
    return (
        f'WorkflowType = "{WORKFLOW_TYPE}" AND {SA_TENANT} = "{check_tenant(tenant)}" '
        f'AND ExecutionStatus = "Running" AND {SA_JOB_STATE} NOT IN ({ended})'
    )


@dataclass
class _Bucket:
    rate: float
    burst: int
    tokens: float
    at: float

    def take(self, now: float) -> float | None:
        """Takes a token; None when there was one, else the seconds until there is."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return None
        return (1 - self.tokens) / self.rate


class _Slots:
    """A count of things in progress with a ceiling; full refuses at once instead of queueing,
    so a client is told to come back rather than held while the gateway drowns."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.used = 0

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        if self.used >= self.limit:
            log.warning("gateway_overloaded", what=self.what, limit=self.limit)
            raise Overloaded(
                f"the gateway has {self.limit} {self.what} open, its limit: try again shortly",
                OVERLOADED_RETRY_AFTER_S,
            )
        self.used += 1
        try:
            yield
        finally:
            self.used -= 1


class Limits:
    def __init__(
        self,
        settings: LimitSources,
        overrides: Mapping[str, TenantLimits] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.overrides = dict(overrides or {})
        self._clock = clock
        # One bucket per tenant: tenants are the configured keys' (or `local`), so few.
        self._buckets: dict[str, _Bucket] = {}
        self._requests = _Slots(settings.gateway_max_requests, "requests")
        self._streams = _Slots(settings.gateway_max_streams, "event streams")

    @classmethod
    def from_settings(
        cls, settings: LimitSources, overrides: Mapping[str, TenantLimits] | None = None
    ) -> Limits:
        """`overrides`: the limits a keys file gives its tenants (`ApiKeys.limits`)."""
        return cls(settings, overrides)

    def rate_of(self, tenant: str) -> tuple[float, int]:
        """The tenant's requests per second and burst. A tenant given a rate but no burst gets
        the defaults' ratio of burst to rate (two seconds' worth), at least 1."""
        own = self.overrides.get(tenant, TenantLimits())
        rate = own.rps or self.settings.tenant_rps
        if own.burst is not None:
            return rate, own.burst
        if own.rps is None:
            return rate, self.settings.tenant_burst
        ratio = self.settings.tenant_burst / self.settings.tenant_rps
        return rate, max(1, math.ceil(rate * ratio))

    def max_jobs_of(self, tenant: str) -> int:
        return self.overrides.get(tenant, TenantLimits()).max_jobs or self.settings.tenant_max_jobs

    def request(self, tenant: str) -> None:
        """Counts one request of `tenant`; RateLimited when its bucket is empty."""
        now = self._clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            rate, burst = self.rate_of(tenant)
            bucket = self._buckets[tenant] = _Bucket(rate, burst, float(burst), now)
        wait = bucket.take(now)
        if wait is not None:
            raise RateLimited(
                f"tenant {tenant} is over its {bucket.rate:g} requests per second "
                f"(burst {bucket.burst})",
                math.ceil(wait),
            )

    async def admit_job(self, tenant: str, client: JobClient, jobs: int = 1) -> None:
        """TooManyJobs when the tenant's jobs in flight and `jobs` more would pass its limit
        (`jobs`: a batch's, admitted whole or not at all).

        Temporal's errors come out as the client's (TemporalUnreachable, ...)."""
        limit = self.max_jobs_of(tenant)
        with client.translated_errors():
            counted = await client.temporal.count_workflows(jobs_in_flight_query(tenant))
        if counted.count + jobs <= limit:
            return
        log.info(
            "tenant_jobs_limit", tenant=tenant, in_flight=counted.count, jobs=jobs, limit=limit
        )
        if jobs == 1:
            message = (
                f"tenant {tenant} has {counted.count} jobs in flight, its limit is {limit}: "
                "submit again once one has ended"
            )
        elif jobs > limit:
            message = (
                f"a batch of {jobs} jobs is over tenant {tenant}'s limit of {limit} jobs in "
                f"flight whatever else runs: send batches of at most {limit} jobs"
            )
        else:
            message = (
                f"tenant {tenant} has {counted.count} jobs in flight and the batch would add "
                f"{jobs}, its limit is {limit}: nothing was started; submit it again once "
                f"{counted.count + jobs - limit} have ended, or send a smaller batch"
            )
        raise TooManyJobs(message, JOBS_RETRY_AFTER_S)

    @property
    def requests_open(self) -> int:
        """Requests this replica is serving now (what a metric or a test may read)."""
        return self._requests.used

    @property
    def streams_open(self) -> int:
        return self._streams.used

    def in_request(self) -> AbstractAsyncContextManager[None]:
        """Held for a request's duration; Overloaded when the replica's limit is reached."""
        return self._requests.held()

    def in_stream(self) -> AbstractAsyncContextManager[None]:
        """Held while an SSE or WebSocket stream is open; Overloaded when too many are."""
        return self._streams.held()
