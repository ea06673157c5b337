"""`JobClient` and a tenant's budget ledger on the time-skipping server: a tenant over its daily
budget whose settings say `refuse` is refused at submission (`BudgetExceeded`, a batch whole),
one whose settings say `wait` is not (its job waits PENDING: tests/workflows/
test_workflow_budgets.py), a job sent again under its ID is answered, and a tenant without a
ledger is never refused."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from starter import BatchRequest, BudgetExceeded, JobClient
from tests.support.workflow_fakes import GRAPH, request
from workflows.budget_ledger import TenantLedger
from workflows.budgets import BudgetLimits, LedgerState
from workflows.contracts import JobRequest
from workflows.inference_job import InferenceJob
from workflows.shared import SIGNAL_LEDGER_LIMITS, ledger_id


@pytest_asyncio.fixture(loop_scope="session")
async def client(env: WorkflowEnvironment) -> AsyncIterator[JobClient]:
    task_queue = f"tq-{uuid.uuid4()}"
    # The jobs' own workflow too, to answer a status query (no activity: nothing runs).
    workflows = [TenantLedger, InferenceJob]
    async with Worker(env.client, task_queue=task_queue, workflows=workflows):
        with env.auto_time_skipping_disabled():
            yield JobClient(env.client, task_queue=task_queue)


async def over_budget(client: JobClient, mode: str) -> str:
    """A tenant whose ledger says it spent 40 of its 30 GPU-seconds today."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    limits = BudgetLimits(tenant=tenant, gpu_seconds_per_day=30, over_budget=mode)
    await client.temporal.start_workflow(
        TenantLedger.run,
        LedgerState(limits=limits, gpu_s=40.0, jobs=2),
        id=ledger_id(tenant),
        task_queue=client.task_queue,
        start_signal=SIGNAL_LEDGER_LIMITS,
        start_signal_args=[limits],
    )
    return tenant


def of(tenant: str, **fields: Any) -> JobRequest:
    return request().model_copy(update={"labels": {"tenant": tenant}, **fields})


async def test_a_tenant_over_budget_that_refuses_is_refused(client: JobClient) -> None:
    tenant = await over_budget(client, "refuse")
    usage = await client.tenant_usage(tenant)
    assert usage is not None and usage.over and usage.over_budget == "refuse"
    with pytest.raises(BudgetExceeded) as refused:
        await client.start(of(tenant), job_id=f"j-{uuid.uuid4().hex}")
    assert refused.value.tenant == tenant and refused.value.resets_at == usage.resets_at
    assert refused.value.spent_gpu_s == 40.0 and refused.value.gpu_seconds_per_day == 30
    assert "40.0 of its 30 GPU-seconds" in str(refused.value)
    batch_id = f"batch-{uuid.uuid4().hex}"
    with pytest.raises(BudgetExceeded):
        await client.submit_batch(
            BatchRequest(requests=[of(tenant), of(tenant)]), batch_id=batch_id
        )
    with pytest.raises(RPCError):  # nothing of it started
        await client.temporal.get_workflow_handle(batch_id).describe()


async def test_a_tenant_that_waits_or_has_no_ledger_is_not_refused(client: JobClient) -> None:
    waits = await over_budget(client, "wait")
    started = await client.start(of(waits), job_id=f"j-{uuid.uuid4().hex}")
    assert not started.existed
    plain = await client.start(of(f"nobody-{uuid.uuid4().hex[:6]}"), job_id=f"j-{uuid.uuid4().hex}")
    assert not plain.existed
    assert await client.tenant_usage("nobody-at-all") is None
    for job_id in (started.status.job_id, plain.status.job_id):
        await client.temporal.get_workflow_handle(job_id).terminate("test over")


async def test_a_job_sent_again_under_its_id_is_answered_not_refused(client: JobClient) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    job_id = f"j-{uuid.uuid4().hex}"
    sent = of(tenant, graph=GRAPH)
    first = await client.start(sent, job_id=job_id)
    assert not first.existed
    # Over budget since (its ledger started afterwards, as by other jobs' spend).
    limits = BudgetLimits(tenant=tenant, gpu_seconds_per_day=30, over_budget="refuse")
    await client.temporal.start_workflow(
        TenantLedger.run,
        LedgerState(limits=limits, gpu_s=31.0, jobs=1),
        id=ledger_id(tenant),
        task_queue=client.task_queue,
    )
    client._budgets._answers.clear()
    again = await client.start(sent, job_id=job_id)
    assert again.existed
    await client.temporal.get_workflow_handle(job_id).terminate("test over")
