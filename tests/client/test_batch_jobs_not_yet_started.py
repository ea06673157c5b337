"""A batch's job its batch's workflow has yet to start, read by a client (the real dev server; no
worker polls the batch's queue, so its jobs stay unstarted for as long as the test needs):
`status` and `events` say QUEUED, `tenant_of` names the batch's tenant (the gateway's tenant
check), `wait` waits for its start, and an ID the batch does not hold is not found."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from devstack.models import RunningStack
from starter import JobClient, JobNotFound, JobRequest
from starter.connection import connect_temporal
from tests.support.cli import example
from workflows.batches import BatchRequest, BatchStatus
from workflows.contracts import JobState


@pytest_asyncio.fixture(loop_scope="session")
async def idle(local_stack: RunningStack) -> AsyncIterator[JobClient]:
    """A client of a task queue no worker polls: a batch submitted there is recorded, and its
    workflow never runs to start its jobs."""
    temporal = await connect_temporal(local_stack.temporal_address, local_stack.namespace)
    yield JobClient(temporal, task_queue=f"no-worker-{uuid.uuid4().hex[:8]}")


async def test_a_job_its_batch_has_yet_to_start_reads_queued_and_is_waited_for(
    idle: JobClient,
) -> None:
    request = JobRequest(graph=example(steps=1), labels={"tenant": "acme"})
    submitted = await idle.submit_batch(BatchRequest(request=request, count=3))
    first, last = submitted.job_ids[0], submitted.job_ids[-1]
    try:
        for job_id in (first, last):
            status = await idle.status(job_id)
            assert status.job_id == job_id and status.state == JobState.QUEUED
            assert (await idle.events(job_id)).status.state == JobState.QUEUED
            assert (await idle.journal(job_id)).status.state == JobState.QUEUED
            assert await idle.tenant_of(job_id) == "acme"
        # Not held by the batch: a number past its jobs, or no batch at all.
        for missing in (f"{submitted.batch_id}-0004", f"nobatch-{uuid.uuid4().hex[:6]}-0001"):
            with pytest.raises(JobNotFound):
                await idle.status(missing)
            with pytest.raises(JobNotFound):
                await idle.tenant_of(missing)
            with pytest.raises(JobNotFound):
                await idle.wait(missing)
        # `wait` waits for the job to be started (and then for its end), not "not found".
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(idle.wait(first), timeout=1.5)
    finally:
        handle = idle.temporal.get_workflow_handle(submitted.batch_id, result_type=BatchStatus)
        await handle.terminate("test over")
    # A batch that ended holds no job that is still to start.
    with pytest.raises(JobNotFound):
        await idle.status(first)
