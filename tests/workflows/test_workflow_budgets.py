"""Tenants' daily budgets on the time-skipping server: the tenant's ledger (`TenantLedger`)
counting its jobs' spend and resetting at the day's end, and real jobs (`InferenceJob` on the
fake backend, whose check reads the ledger through the real activities/budgets.py) that run
while the spend is under the budget, wait `PENDING` held by it once it is reached, and run after
the reset; and each job's spend told to the ledger at its end."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from configuration.tenants import TenantConfig
from tests.support.workflow_fakes import FakeBackend, Script, job_worker, outcome, request
from workflows.budget_ledger import TenantLedger
from workflows.budgets import RESET_JITTER_MAX_S, BudgetLimits, BudgetUsage, LedgerState, Spent
from workflows.contracts import JobRequest, JobState, JobStatus
from workflows.job_input import JobInput
from workflows.shared import (
    LEDGER_WORKFLOW_TYPE,
    QUERY_LEDGER_USAGE,
    QUERY_STATUS,
    SIGNAL_LEDGER_LIMITS,
    SIGNAL_LEDGER_SPENT,
    WORKFLOW_TYPE,
    ledger_id,
)

DAY_S = 86400.0
BUDGET = {"acme": TenantConfig(gpu_seconds_per_day=30)}


def tenant_job(tenant: str, **policy: Any) -> JobRequest:
    return request(**policy).model_copy(update={"labels": {"tenant": tenant}})


async def usage_of(client: Client, tenant: str) -> BudgetUsage:
    handle = client.get_workflow_handle(ledger_id(tenant))
    usage: BudgetUsage = await handle.query(QUERY_LEDGER_USAGE, result_type=BudgetUsage)
    return usage


async def start(client: Client, task_queue: str, job: JobRequest) -> WorkflowHandle[Any, JobStatus]:
    return await client.start_workflow(
        WORKFLOW_TYPE,
        JobInput(request=job),
        id=f"job-{uuid.uuid4()}",
        task_queue=task_queue,
        result_type=JobStatus,
    )


async def skip_past(env: WorkflowEnvironment, at: datetime | None) -> None:
    """The server's clock past `at` and a held job's jitter after it."""
    assert at is not None
    now = await env.get_current_time()
    await env.sleep(at - now + timedelta(seconds=RESET_JITTER_MAX_S + 5))


async def status_when(
    handle: WorkflowHandle[Any, JobStatus], state: JobState, within_s: float = 20
) -> JobStatus:
    async with asyncio.timeout(within_s):
        while True:
            status: JobStatus = await handle.query(QUERY_STATUS, result_type=JobStatus)
            if status.state == state:
                return status
            assert not status.terminal, status.model_dump_json(indent=1)
            await asyncio.sleep(0.05)


async def test_the_ledger_counts_each_job_once_and_resets_at_the_days_end(
    env: WorkflowEnvironment,
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    task_queue = f"tq-{uuid.uuid4()}"
    limits = BudgetLimits(tenant=tenant, gpu_seconds_per_day=30, day_s=600)
    async with Worker(env.client, task_queue=task_queue, workflows=[TenantLedger]):
        handle = await env.client.start_workflow(
            LEDGER_WORKFLOW_TYPE,
            LedgerState(limits=limits),
            id=ledger_id(tenant),
            task_queue=task_queue,
            start_signal=SIGNAL_LEDGER_LIMITS,
            start_signal_args=[limits],
        )
        for spent in (Spent(job_id="a", gpu_s=20), Spent(job_id="a", gpu_s=20), "garbage"):
            await handle.signal(SIGNAL_LEDGER_SPENT, spent)
        await handle.signal(SIGNAL_LEDGER_SPENT, Spent(job_id="b", gpu_s=12.5, usd=0.01))
        usage = await usage_of(env.client, tenant)
        assert (usage.gpu_s, usage.usd, usage.jobs, usage.over) == (32.5, 0.01, 2, True)
        assert usage.resets_at is not None and usage.day_started_at is not None
        assert (usage.resets_at - usage.day_started_at).total_seconds() == 600
        first_run = (await handle.describe()).run_id
        await env.sleep(timedelta(seconds=601))
        after = await usage_of(env.client, tenant)
        assert (after.gpu_s, after.jobs, after.over) == (0.0, 0, False)
        assert after.resets_at == usage.resets_at + timedelta(seconds=600)
        assert (await handle.describe()).run_id != first_run, "continued as new at the reset"
        # Yesterday's job told again is not counted today.
        await handle.signal(SIGNAL_LEDGER_SPENT, Spent(job_id="a", gpu_s=20))
        assert (await usage_of(env.client, tenant)).gpu_s == 0.0
        await handle.terminate("test over")


async def test_jobs_run_until_the_spend_passes_the_budget_then_wait_for_the_reset(
    env: WorkflowEnvironment,
) -> None:
    """Each job's provider job runs 20 s: the first two run (0, then 20 s spent, both under
    30), the third is PENDING, held by the budget (40 s spent), and runs once the day resets."""
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    backend = FakeBackend(
        Script(tenants={tenant: TenantConfig(gpu_seconds_per_day=30)}, cost_s=20.0)
    )
    async with job_worker(env.client, backend) as task_queue:
        # Real time, and the reset reached by an explicit skip: skipped by itself, the server
        # would also pass the ledger's next reset before the test reads it.
        with env.auto_time_skipping_disabled():
            for _ in range(2):
                handle = await start(env.client, task_queue, tenant_job(tenant))
                final, error = await outcome(handle)
                assert error is None and final.state == JobState.COMPLETED
                assert final.gpu_s == 20.0
            usage = await usage_of(env.client, tenant)
            assert (usage.gpu_s, usage.jobs, usage.over) == (40.0, 2, True)
            held = await start(env.client, task_queue, tenant_job(tenant))
            pending = await status_when(held, JobState.PENDING)
            assert pending.admission is not None and pending.admission.held == "budget"
            assert pending.admission.resets_at == usage.resets_at
            assert len(backend.submitted) == 2, "nothing of the held job was submitted"
            await skip_past(env, usage.resets_at)
            final = await status_when(held, JobState.COMPLETED)
            assert final.admission is None
            assert len(backend.submitted) == 3
            after = await usage_of(env.client, tenant)
            assert (after.gpu_s, after.jobs) == (20.0, 1), "counted on the new day"
            assert usage.resets_at is not None
            assert after.resets_at == usage.resets_at + timedelta(days=1)
        events = [e async for e in held.fetch_history_events()]
        timers = [
            e.timer_started_event_attributes
            for e in events
            if e.HasField("timer_started_event_attributes")
        ]
        assert timers, "a durable timer until the reset"
        await env.client.get_workflow_handle(ledger_id(tenant)).terminate("test over")


async def test_a_job_with_input_files_is_held_at_its_prepare(env: WorkflowEnvironment) -> None:
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    backend = FakeBackend(
        Script(tenants={tenant: TenantConfig(gpu_seconds_per_day=30)}, cost_s=31.0)
    )
    with_input = tenant_job(tenant)
    graph = dict(with_input.graph)
    graph["3"] = {"class_type": "LoadImage", "inputs": {"image": "in.png"}}
    with_input = JobRequest.model_validate(
        with_input.model_dump(mode="json")
        | {
            "graph": graph,
            "inputs": {"in.png": {"kind": "inline", "filename": "in.png", "data_b64": "aGk="}},
        }
    )
    async with job_worker(env.client, backend) as task_queue:
        with env.auto_time_skipping_disabled():
            first, error = await outcome(await start(env.client, task_queue, with_input))
            assert error is None and first.state == JobState.COMPLETED
            held = await start(env.client, task_queue, with_input)
            pending = await status_when(held, JobState.PENDING)
            assert pending.admission is not None and pending.admission.held == "budget"
            await skip_past(env, pending.admission.resets_at)
            final = await status_when(held, JobState.COMPLETED)
        # Prepared twice: held, then again after the reset.
        assert sum(1 for p in backend.prepared if p.job_id == final.job_id) == 2
        await env.client.get_workflow_handle(ledger_id(tenant)).terminate("test over")


async def test_a_held_job_cancelled_stops_nothing(env: WorkflowEnvironment) -> None:
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    backend = FakeBackend(
        Script(tenants={tenant: TenantConfig(gpu_seconds_per_day=10)}, cost_s=12.0)
    )
    async with job_worker(env.client, backend) as task_queue:
        with env.auto_time_skipping_disabled():
            first, _ = await outcome(await start(env.client, task_queue, tenant_job(tenant)))
            assert first.state == JobState.COMPLETED
            held = await start(env.client, task_queue, tenant_job(tenant))
            await status_when(held, JobState.PENDING)
            await held.signal("cancel", {"reason": "not today"})
            final, _ = await outcome(held)
        assert final.state == JobState.CANCELLED
        assert final.teardown.state == "SKIPPED"
        assert backend.teardowns == []
        usage = await usage_of(env.client, tenant)
        assert usage.jobs == 1, "a job that never ran tells its ledger nothing"
        await env.client.get_workflow_handle(ledger_id(tenant)).terminate("test over")


async def test_an_unbudgeted_tenants_job_asks_no_ledger(env: WorkflowEnvironment) -> None:
    backend = FakeBackend(Script(tenants={"someone-else": TenantConfig(usd_per_day=1)}))
    async with job_worker(env.client, backend) as task_queue:
        handle = await start(env.client, task_queue, tenant_job("free"))
        final, error = await outcome(handle)
        assert error is None and final.state == JobState.COMPLETED
        events = [e async for e in handle.fetch_history_events()]
        signalled = [
            e
            for e in events
            if e.HasField("signal_external_workflow_execution_initiated_event_attributes")
        ]
        assert signalled == []


async def test_a_jobs_spend_reaches_a_ledger_that_was_terminated(
    env: WorkflowEnvironment,
) -> None:
    """The ledger is terminated while the job runs: at its end the job's external signal finds
    none, and an activity starts it again with the spend (signal-with-start)."""
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    backend = FakeBackend(
        Script(tenants={tenant: TenantConfig(gpu_seconds_per_day=100)}, cost_s=5.0)
    )
    backend.follow_gate = asyncio.Event()
    async with job_worker(env.client, backend) as task_queue:
        with env.auto_time_skipping_disabled():
            handle = await start(env.client, task_queue, tenant_job(tenant))
            await status_when(handle, JobState.RUNNING)
            ledger = env.client.get_workflow_handle(ledger_id(tenant))
            await ledger.terminate("operator")
            backend.follow_gate.set()
            final, error = await outcome(handle)
        assert error is None and final.state == JobState.COMPLETED
        usage = await usage_of(env.client, tenant)
        assert (usage.gpu_s, usage.jobs) == (5.0, 1)
        assert usage.gpu_seconds_per_day == 100, "started with the worker's limits"
        await env.client.get_workflow_handle(ledger_id(tenant)).terminate("test over")
