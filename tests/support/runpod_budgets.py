"""What the budget tests on the RunPod simulator share: a worker of ours whose tenants have
budgets and whose budget day is short and begins as the test does, and the reads they check.

A budget day is counted from the Unix epoch in steps of `DURABLE_COMFY_BUDGET_DAY_S`; a test
with a fixed length would first wait, on average, for a fresh day. `day_beginning_at` picks a
length within a second of the one asked for whose day begins when the test does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta

from configuration.tenants import TenantConfig
from devstack.models import RunningStack
from devstack.runpod_sim import Ledger
from starter import JobClient
from tests.support.runpod_e2e import POOL, job, runpod_pool, serving
from tests.support.runpod_sim import RunpodSim
from workflows.budgets import EPOCH, BudgetUsage, day_of
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.shared import ledger_id

# What a RunPod job's `executionTime` and the simulator's billing may differ by (clock reads).
SLACK_S = 1.0


def day_beginning_at(at: datetime, about_s: float) -> float:
    """A budget day's length, within a second of `about_s` (a day of a minute or more), whose
    days begin at `at`: `at` is a whole number of such days after the epoch."""
    since = (at - EPOCH).total_seconds()
    length = since / math.floor(since / about_s)
    start, _end = day_of(at + timedelta(milliseconds=1), length)
    assert abs((start - at).total_seconds()) < 0.01, (start, at, length)
    return length


@contextlib.asynccontextmanager
async def budgeted(
    stack: RunningStack, sim: RunpodSim, tenants: Mapping[str, TenantConfig], about_s: float
) -> AsyncIterator[tuple[JobClient, float]]:
    """A worker of ours on `sim`'s pool with `tenants`' budgets, its budget day about `about_s`
    long and beginning now: the client, and the day's exact length. The tenants' ledgers are
    terminated at the end."""
    day_s = day_beginning_at(datetime.now(UTC) + timedelta(seconds=1), about_s)
    pool = runpod_pool(sim)
    async with serving(stack, {POOL: pool}, tenants=dict(tenants), budget_day_s=day_s) as (
        client,
        _store,
    ):
        yield client, day_s
        for tenant in tenants:
            handle = client.temporal.get_workflow_handle(ledger_id(tenant))
            with contextlib.suppress(Exception):
                await handle.terminate("test over")


def of_tenant(tenant: str, steps: int) -> JobRequest:
    """A job of `tenant`, its seed its own (ComfyUI serves a graph it ran before from its cache,
    in no time)."""
    request = job(steps=steps, progress_interval_s=1.0)
    graph = request.graph
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**48
    return request.model_copy(update={"labels": {"tenant": tenant}, "graph": graph})


async def usage(client: JobClient, tenant: str) -> BudgetUsage:
    found = await client.tenant_usage(tenant)
    assert found is not None, f"no ledger for {tenant}"
    return found


def billed(ledger: Ledger, statuses: list[JobStatus]) -> float:
    """What the simulator billed for the jobs' RunPod jobs (every delivery's execution)."""
    ours = {cost.provider_job_id for status in statuses for cost in status.cost}
    return sum(provider_job.billed_s for provider_job in ledger.jobs if provider_job.id in ours)


async def state_of(client: JobClient, job_id: str, *states: JobState, within_s: float) -> JobStatus:
    async with asyncio.timeout(within_s):
        while True:
            status = await client.status(job_id)
            if status.state in states:
                return status
            assert not status.terminal, status.model_dump_json(indent=1)
            await asyncio.sleep(0.25)


async def until(moment: datetime, after_s: float = 0.0) -> None:
    """Sleep until `after_s` past `moment`."""
    await asyncio.sleep(max((moment - datetime.now(UTC)).total_seconds(), 0.0) + after_s)
