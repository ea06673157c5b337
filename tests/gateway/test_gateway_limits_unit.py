"""The gateway's limits (gateway.limits): a tenant's requests per second on an injected clock
(no sleeping), its jobs in flight against a fake count and once against the real dev server's
visibility, and the replica's ceilings on requests and streams."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from temporalio.client import Client, WorkflowExecutionCount
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from configuration.settings import LimitSettings
from devstack.models import RunningStack
from gateway.auth import TenantLimits
from gateway.errors import Overloaded, RateLimited, TooManyJobs
from gateway.limits import Limits, jobs_in_flight_query
from starter import JobClient, JobRequest
from starter.client import TENANT_KEY
from starter.connection import connect_temporal
from starter.errors import TemporalUnreachable
from tests.support.cli import example
from workflows.contracts import JobState
from workflows.job_input import JobInput
from workflows.shared import STATE_KEY, WORKFLOW_TYPE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**values: Any) -> LimitSettings:
    names = {
        "rps": "DURABLE_COMFY_TENANT_RPS",
        "burst": "DURABLE_COMFY_TENANT_BURST",
        "max_jobs": "DURABLE_COMFY_TENANT_MAX_JOBS",
        "requests": "DURABLE_COMFY_GATEWAY_MAX_REQUESTS",
        "streams": "DURABLE_COMFY_GATEWAY_MAX_STREAMS",
    }
    return LimitSettings.model_validate({names[k]: v for k, v in values.items()})


def limits(clock: Clock, overrides: dict[str, TenantLimits] | None = None, **values: Any) -> Limits:
    return Limits(settings(**values), overrides, clock=clock)


def admitted(limits: Limits, tenant: str, n: int) -> int:
    """How many of n requests at the clock's present moment get through."""
    passed = 0
    for _ in range(n):
        try:
            limits.request(tenant)
            passed += 1
        except RateLimited:
            pass
    return passed


# --- requests per second ---------------------------------------------------------------------


def test_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(LimitSettings.model_fields):
        monkeypatch.delenv(f"DURABLE_COMFY_{name.upper()}", raising=False)
    monkeypatch.delenv("DURABLE_COMFY_SETTINGS_FILE", raising=False)
    defaults = LimitSettings()
    assert (defaults.tenant_rps, defaults.tenant_burst, defaults.tenant_max_jobs) == (20, 40, 2000)
    assert (defaults.gateway_max_requests, defaults.gateway_max_streams) == (256, 10_000)


def test_the_variables_reach_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_COMFY_TENANT_RPS", "2.5")
    monkeypatch.setenv("DURABLE_COMFY_TENANT_BURST", "3")
    monkeypatch.setenv("DURABLE_COMFY_TENANT_MAX_JOBS", "7")
    monkeypatch.setenv("DURABLE_COMFY_GATEWAY_MAX_REQUESTS", "8")
    monkeypatch.setenv("DURABLE_COMFY_GATEWAY_MAX_STREAMS", "9")
    read = Limits.from_settings(LimitSettings())
    assert read.rate_of("acme") == (2.5, 3) and read.max_jobs_of("acme") == 7
    assert (read.settings.gateway_max_requests, read.settings.gateway_max_streams) == (8, 9)


@pytest.mark.parametrize("bad", [{"rps": 0}, {"rps": "inf"}, {"burst": 0}, {"max_jobs": -1}])
def test_nonsense_limits_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="DURABLE_COMFY_"):
        settings(**bad)


def test_a_burst_then_one_request_per_token() -> None:
    clock = Clock()
    rps = limits(clock, rps=2, burst=4)

    assert admitted(rps, "acme", 10) == 4
    clock.now += 0.5  # one token
    assert admitted(rps, "acme", 10) == 1
    clock.now += 0.25  # half a token: none
    assert admitted(rps, "acme", 10) == 0
    clock.now += 0.25
    assert admitted(rps, "acme", 10) == 1
    clock.now += 3600  # refills up to the burst, no further
    assert admitted(rps, "acme", 10) == 4


def test_tenants_have_buckets_of_their_own() -> None:
    clock = Clock()
    rps = limits(clock, rps=1, burst=2)
    assert admitted(rps, "acme", 5) == 2
    assert admitted(rps, "globex", 5) == 2


def test_retry_after_is_the_wait_for_the_next_token_rounded_up() -> None:
    clock = Clock()
    slow = limits(clock, rps=0.1, burst=1)  # a token every 10 s
    slow.request("acme")
    with pytest.raises(RateLimited, match=r"over its 0\.1 requests per second") as raised:
        slow.request("acme")
    assert raised.value.retry_after_s == 10
    clock.now += 2.5
    with pytest.raises(RateLimited) as raised:
        slow.request("acme")
    assert raised.value.retry_after_s == 8  # 7.5 s, rounded up
    clock.now += 7.4
    with pytest.raises(RateLimited) as raised:
        slow.request("acme")
    assert raised.value.retry_after_s == 1  # 0.1 s, and never 0
    clock.now += 0.1
    slow.request("acme")


def test_a_refused_request_takes_no_token() -> None:
    clock = Clock()
    slow = limits(clock, rps=1, burst=1)
    slow.request("acme")
    for _ in range(50):  # a client hammering while limited does not dig itself deeper
        with pytest.raises(RateLimited):
            slow.request("acme")
    clock.now += 1
    slow.request("acme")


def test_a_tenants_own_rate_and_burst() -> None:
    clock = Clock()
    own = {
        "slow": TenantLimits(rps=1),
        "fast": TenantLimits(rps=100, burst=7),
        "few": TenantLimits(max_jobs=3),
    }
    rps = limits(clock, own, rps=10, burst=20, max_jobs=50)
    assert rps.rate_of("slow") == (1, 2)  # the defaults' burst of two seconds
    assert rps.rate_of("fast") == (100, 7)
    assert rps.rate_of("few") == (10, 20) and rps.max_jobs_of("few") == 3
    assert rps.rate_of("anyone") == (10, 20) and rps.max_jobs_of("anyone") == 50
    assert admitted(rps, "slow", 10) == 2
    assert admitted(rps, "fast", 10) == 7


# --- jobs in flight --------------------------------------------------------------------------


class FakeTemporal:
    def __init__(self, count: int) -> None:
        self.count = count
        self.queries: list[str] = []

    async def count_workflows(self, query: str) -> WorkflowExecutionCount:
        self.queries.append(query)
        return WorkflowExecutionCount(count=self.count, groups=[])


def fake_client(temporal: Any) -> JobClient:
    return JobClient(cast(Client, temporal), task_queue="unused")


async def test_jobs_up_to_the_limit_are_admitted_then_too_many() -> None:
    temporal = FakeTemporal(count=2)
    jobs = limits(Clock(), max_jobs=3)
    await jobs.admit_job("acme", fake_client(temporal))
    temporal.count = 3
    with pytest.raises(TooManyJobs, match="acme has 3 jobs in flight, its limit is 3") as raised:
        await jobs.admit_job("acme", fake_client(temporal))
    assert raised.value.retry_after_s == 5
    assert temporal.queries == [jobs_in_flight_query("acme")] * 2


async def test_a_tenants_own_job_limit() -> None:
    temporal = FakeTemporal(count=1)
    jobs = limits(Clock(), {"few": TenantLimits(max_jobs=1)}, max_jobs=100)
    await jobs.admit_job("many", fake_client(temporal))
    with pytest.raises(TooManyJobs):
        await jobs.admit_job("few", fake_client(temporal))


async def test_temporal_unreachable_while_counting_is_the_clients_error() -> None:
    from temporalio.service import RPCError, RPCStatusCode

    class Down:
        service_client = type("S", (), {"config": type("C", (), {"target_host": "h:1"})()})()

        async def count_workflows(self, query: str) -> WorkflowExecutionCount:
            raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")

    with pytest.raises(TemporalUnreachable):
        await limits(Clock()).admit_job("acme", fake_client(Down()))


def test_the_query_counts_only_the_tenants_unended_jobs() -> None:
    query = jobs_in_flight_query("acme")
    assert query.startswith(f'WorkflowType = "{WORKFLOW_TYPE}" AND Tenant = "acme" AND ')
    assert 'ExecutionStatus = "Running"' in query
    for ended in ("COMPLETED", "FAILED", "CANCELLED", "ABANDONED", "EXPIRED"):
        assert f'"{ended}"' in query.split("NOT IN", 1)[1]
    with pytest.raises(ValueError, match="tenant name"):
        jobs_in_flight_query('x" OR Tenant != "')


@pytest.fixture
async def temporal(local_stack: RunningStack) -> AsyncIterator[Client]:
    client = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    yield client


async def test_jobs_in_flight_counted_by_the_real_dev_server(temporal: Client) -> None:
    """Queued jobs count (no worker serves their queue); another tenant's, a terminated one and
    one whose workflow stays open after its end (delivering webhooks) do not."""
    queue = f"no-worker-{uuid.uuid4().hex[:8]}"
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    client = JobClient(temporal, task_queue=queue)
    started: list[str] = []

    async def submit(who: str) -> str:
        request = JobRequest(graph=example(), labels={"tenant": who})
        status = await client.submit(request)
        started.append(status.job_id)
        return status.job_id

    try:
        for _ in range(3):
            await submit(tenant)
        await submit(f"other-{tenant}")
        ended = await submit(tenant)
        await client.handle(ended).terminate("test: an ended job")
        # A job that has ended (its JobState says so) while its workflow is still open.
        still_open = f"ended-open-{uuid.uuid4().hex[:8]}"
        await temporal.start_workflow(
            WORKFLOW_TYPE,
            JobInput(request=JobRequest(graph=example(), labels={"tenant": tenant})),
            id=still_open,
            task_queue=queue,
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(STATE_KEY, JobState.COMPLETED.value),
                    SearchAttributePair(TENANT_KEY, tenant),
                ]
            ),
        )
        started.append(still_open)

        # Visibility follows the jobs shortly after: wait until it has seen them all.
        everything = f'Tenant = "{tenant}"'
        for _ in range(100):
            if (await temporal.count_workflows(everything)).count == 5:
                break
            await asyncio.sleep(0.1)

        counted = await temporal.count_workflows(jobs_in_flight_query(tenant))
        assert counted.count == 3
        await limits(Clock(), max_jobs=4).admit_job(tenant, client)
        with pytest.raises(TooManyJobs, match=f"{tenant} has 3 jobs in flight, its limit is 3"):
            await limits(Clock(), max_jobs=3).admit_job(tenant, client)
    finally:
        for job_id in started:
            try:
                await client.handle(job_id).terminate("test over")
            except Exception:  # already ended
                pass


# --- the replica's ceilings ------------------------------------------------------------------


async def test_requests_beyond_the_ceiling_are_overloaded_until_one_ends() -> None:
    gateway = limits(Clock(), requests=2)
    async with gateway.in_request(), gateway.in_request():
        with pytest.raises(Overloaded, match="2 requests open") as raised:
            async with gateway.in_request():
                pass
        assert raised.value.retry_after_s == 1
        # Streams are counted apart.
        async with gateway.in_stream():
            pass
    async with gateway.in_request(), gateway.in_request():
        pass


async def test_streams_beyond_the_ceiling_are_overloaded_and_a_failure_frees_its_slot() -> None:
    gateway = limits(Clock(), streams=1)
    with pytest.raises(RuntimeError):
        async with gateway.in_stream():
            raise RuntimeError("the client went away")
    async with gateway.in_stream():
        with pytest.raises(Overloaded, match="1 event streams open"):
            async with gateway.in_stream():
                pass
