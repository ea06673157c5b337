"""Record the batch replay histories: `python -m tests.workflows.batch_histories.record`.

Runs `JobBatch` on the time-skipping server with its real activities (activities/batches.py; its
jobs' starts by a start of this module's, as the worker's `JobClient.start_batch_job` does) and
real jobs (`InferenceJob` on the stand-in backend, tests/support/workflow_fakes.py), and writes
the batch's history of each scenario as `<scenario>.json` beside this file:

- `started_by_batch`: three jobs in short (`BatchJobs`), started by the batch's own activity,
  each telling its end; its webhook answered 503 once, then delivered;
- `started_by_client`: two jobs started from outside, then `submitted`;
- `cancelled`: three jobs in short, the batch cancelled as soon as it started (whatever its
  starts had done by then: the cancel stops them, then tells the started jobs).

tests/workflows/test_replay_batch_histories.py replays each against today's `JobBatch`. A batch
is pinned to its worker version like a job (docs/upgrading.md): a change to its commands is
re-recorded here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.worker import Worker

from activities.batches import BatchActivities
from tests.support.workflow_fakes import GRAPH, FakeBackend, Script, start_time_skipping
from tests.workflows.histories.record import FakeReceiver, write_history
from workflows.batches import BatchInput, BatchStatus, compact_jobs
from workflows.budget_ledger import TenantLedger
from workflows.contracts import JobPolicy, JobRequest, WebhookSpec
from workflows.inference_job import InferenceJob
from workflows.job_batch import JobBatch
from workflows.job_input import JobInput
from workflows.pool_queue import PoolQueue
from workflows.shared import (
    BATCH_LABEL,
    SIGNAL_BATCH_SUBMITTED,
    UPDATE_BATCH_CANCEL,
    WORKFLOW_TYPE,
)

HERE = Path(__file__).parent
WEBHOOK = WebhookSpec(url="https://hooks.example.com/batch", retry_horizon_s=600)

Scenario = Callable[[Client, str], Awaitable[WorkflowHandle[Any, BatchStatus]]]


def job(batch_id: str, width: int) -> JobRequest:
    graph = {**GRAPH, "1": {**GRAPH["1"], "inputs": {**GRAPH["1"]["inputs"], "width": width}}}
    return JobRequest(
        graph=graph,
        labels={BATCH_LABEL: batch_id},
        policy=JobPolicy(abandon_after_s=None, heartbeat_timeout_s=1),
    )


def starter(client: Client, task_queue: str) -> Callable[[JobRequest, str, bool], Awaitable[str]]:
    async def start(request: JobRequest, job_id: str, detached: bool) -> str:
        try:
            await client.start_workflow(
                WORKFLOW_TYPE, JobInput(request=request), id=job_id, task_queue=task_queue
            )
        except WorkflowAlreadyStartedError:
            return "existed"
        return "started"

    return start


async def in_short(
    client: Client, task_queue: str, name: str, webhook: WebhookSpec | None = None
) -> WorkflowHandle[Any, BatchStatus]:
    batch_id = f"batch-{name}"
    jobs = compact_jobs([job(batch_id, 64 + 8 * n) for n in range(3)], detached=True)
    assert jobs is not None
    batch = BatchInput(
        batch_id=batch_id,
        tenant="acme",
        job_ids=[f"{batch_id}-{n:04d}" for n in (1, 2, 3)],
        webhook=webhook,
        created_at=datetime(2026, 12, 7, tzinfo=UTC),
        jobs=jobs,
    )
    return await client.start_workflow(JobBatch.run, batch, id=batch_id, task_queue=task_queue)


async def started_by_batch(client: Client, task_queue: str) -> WorkflowHandle[Any, BatchStatus]:
    return await in_short(client, task_queue, "started_by_batch", WEBHOOK)


async def started_by_client(client: Client, task_queue: str) -> WorkflowHandle[Any, BatchStatus]:
    batch_id = "batch-started_by_client"
    job_ids = [f"{batch_id}-{n:04d}" for n in (1, 2)]
    batch = BatchInput(
        batch_id=batch_id,
        tenant="acme",
        job_ids=job_ids,
        created_at=datetime(2026, 12, 7, tzinfo=UTC),
    )
    handle = await client.start_workflow(JobBatch.run, batch, id=batch_id, task_queue=task_queue)
    for n, job_id in enumerate(job_ids):
        await client.start_workflow(
            WORKFLOW_TYPE, JobInput(request=job(batch_id, 64 + n)), id=job_id, task_queue=task_queue
        )
    await handle.signal(SIGNAL_BATCH_SUBMITTED)
    return handle


async def cancelled(client: Client, task_queue: str) -> WorkflowHandle[Any, BatchStatus]:
    handle = await in_short(client, task_queue, "cancelled")
    await handle.execute_update(UPDATE_BATCH_CANCEL, {"reason": "recorded"})
    return handle


SCENARIOS: dict[str, Scenario] = {
    "started_by_batch": started_by_batch,
    "started_by_client": started_by_client,
    "cancelled": cancelled,
}


async def record() -> None:
    env = await start_time_skipping()
    try:
        for name, scenario in SCENARIOS.items():
            task_queue = f"record-batch-{name}"
            backend = FakeBackend(Script())
            batches = BatchActivities(env.client, starter(env.client, task_queue))
            async with Worker(
                env.client,
                task_queue=task_queue,
                workflows=[InferenceJob, PoolQueue, JobBatch, TenantLedger],
                activities=[
                    *backend.activities(),
                    FakeReceiver().deliver_webhook,
                    batches.start_batch_jobs,
                    batches.cancel_batch_jobs,
                    batches.ended_batch_jobs,
                ],
                graceful_shutdown_timeout=timedelta(seconds=1),
                max_heartbeat_throttle_interval=timedelta(seconds=0.1),
            ):
                handle = await scenario(env.client, task_queue)
                await asyncio.wait_for(handle.result(), timeout=120)
                history = await handle.fetch_history()
            write_history(HERE / f"{name}.json", history)
    finally:
        await env.shutdown()


if __name__ == "__main__":
    asyncio.run(record())
