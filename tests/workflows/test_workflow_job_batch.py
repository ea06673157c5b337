"""A batch's workflow (`JobBatch`) on the time-skipping server: real jobs (`InferenceJob` on the
fake backend) telling it their ends, its own look for jobs that ended unheard or never
started, its cancel, and its one webhook, with stand-in activities for its calls."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.support.workflow_fakes import FakeBackend, Script, job_worker, request
from workflows.activity_io import WebhookAttempt, WebhookDeliveryInput
from workflows.batches import BatchInput, BatchJobEnd, BatchResults, BatchState, BatchStatus
from workflows.contracts import JobStatus, WebhookSpec
from workflows.job_batch import LOOK_EVERY_S, START_GRACE_S, JobBatch
from workflows.job_input import JobInput
from workflows.shared import (
    ACTIVITY_CANCEL_BATCH_JOBS,
    ACTIVITY_DELIVER_WEBHOOK,
    ACTIVITY_ENDED_BATCH_JOBS,
    BATCH_LABEL,
    BATCH_WORKFLOW_TYPE,
    QUERY_BATCH_RESULTS,
    QUERY_BATCH_STATUS,
    SIGNAL_BATCH_JOB_ENDED,
    SIGNAL_BATCH_SUBMITTED,
    UPDATE_BATCH_CANCEL,
    WORKFLOW_TYPE,
)


class Calls:
    """The batch's activities, scripted, with what each was asked."""

    def __init__(self) -> None:
        self.cancelled: list[tuple[list[str], str]] = []
        self.never_started: list[str] = []
        self.looks: list[tuple[list[str], bool]] = []
        self.found: list[BatchJobEnd] = []
        self.webhooks: list[WebhookDeliveryInput] = []
        self.webhook_outcomes: list[str] = []

    @activity.defn(name=ACTIVITY_CANCEL_BATCH_JOBS)
    async def cancel_batch_jobs(self, job_ids: list[str], reason: str) -> list[str]:
        self.cancelled.append((job_ids, reason))
        return [job_id for job_id in job_ids if job_id in self.never_started]

    @activity.defn(name=ACTIVITY_ENDED_BATCH_JOBS)
    async def ended_batch_jobs(
        self, batch_id: str, unheard: list[str], started_all: bool
    ) -> list[BatchJobEnd]:
        self.looks.append((unheard, started_all))
        found, self.found = self.found, []
        return found

    @activity.defn(name=ACTIVITY_DELIVER_WEBHOOK)
    async def deliver_webhook(self, req: WebhookDeliveryInput) -> WebhookAttempt:
        self.webhooks.append(req)
        outcome: Any = self.webhook_outcomes.pop(0) if self.webhook_outcomes else "delivered"
        return WebhookAttempt(outcome=outcome, at=datetime.now(UTC))


@contextlib.asynccontextmanager
async def batch_worker(client: Client, calls: Calls) -> AsyncIterator[str]:
    task_queue = f"batch-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[JobBatch],
        activities=[calls.cancel_batch_jobs, calls.ended_batch_jobs, calls.deliver_webhook],
        graceful_shutdown_timeout=timedelta(seconds=1),
    ):
        yield task_queue


async def start_batch(
    client: Client, task_queue: str, jobs: int, webhook: WebhookSpec | None = None
) -> tuple[WorkflowHandle[Any, BatchStatus], list[str]]:
    batch_id = f"batch-{uuid.uuid4().hex[:8]}"
    job_ids = [f"{batch_id}-{n:04d}" for n in range(1, jobs + 1)]
    handle = await client.start_workflow(
        BATCH_WORKFLOW_TYPE,
        BatchInput(batch_id=batch_id, job_ids=job_ids, webhook=webhook, tenant="acme"),
        id=batch_id,
        task_queue=task_queue,
        result_type=BatchStatus,
    )
    return handle, job_ids


def end(job_id: str, state: str = "COMPLETED", gpu_s: float = 0.0) -> BatchJobEnd:
    return BatchJobEnd(job_id=job_id, state=state, gpu_s=gpu_s, usd=gpu_s / 10 or None)


async def test_real_jobs_tell_their_batch_which_ends_when_the_last_has(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    backend = FakeBackend(Script())
    async with (
        batch_worker(env.client, calls) as batch_queue,
        job_worker(env.client, backend) as job_queue,
    ):
        handle, job_ids = await start_batch(env.client, batch_queue, 2)
        jobs = []
        for job_id in job_ids:
            job = request()
            job = job.model_copy(update={"labels": {BATCH_LABEL: handle.id}})
            jobs.append(
                await env.client.start_workflow(
                    WORKFLOW_TYPE,
                    JobInput(request=job),
                    id=job_id,
                    task_queue=job_queue,
                    result_type=JobStatus,
                )
            )
        await handle.signal(SIGNAL_BATCH_SUBMITTED)
        # Bounded: a batch its jobs never tell would wait for its look (which finds nothing
        # here) for ever.
        final = await asyncio.wait_for(handle.result(), timeout=60)
        assert final.state == BatchState.COMPLETED
        assert final.counts == {"COMPLETED": 2} and final.ended == 2 and final.progress == 1.0
        assert final.artifacts == 2
        assert [job.state for job in final.jobs] == ["COMPLETED", "COMPLETED"]
        results = await handle.query(QUERY_BATCH_RESULTS, result_type=BatchResults)
        assert [r.job_id for r in results.ends] == job_ids
        assert all(r.source == "job" and len(r.artifacts) == 1 for r in results.ends)
        assert [(await job.result()).state for job in jobs] == ["COMPLETED", "COMPLETED"]


async def test_a_job_that_ends_unheard_is_found_by_the_batchs_look(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    async with batch_worker(env.client, calls) as task_queue:
        handle, [first, second] = await start_batch(env.client, task_queue, 2)
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(first, gpu_s=3.0))
        # The second job was terminated from outside: it never tells; the look finds it.
        calls.found = [end(second, state="TERMINATED").model_copy(update={"source": "found"})]
        await env.sleep(LOOK_EVERY_S + 1)
        final = await handle.result()
        assert final.counts == {"COMPLETED": 1, "TERMINATED": 1}
        assert final.cost.gpu_s == 3.0 and final.cost.usd == 0.3
        # It asked only about the job it had not heard of, and (no `submitted`, inside the
        # grace) not yet about jobs that may still be starting.
        assert calls.looks[0] == ([second], False)


async def test_after_the_start_grace_the_look_may_count_jobs_that_never_started(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    async with batch_worker(env.client, calls) as task_queue:
        handle, [only] = await start_batch(env.client, task_queue, 1)
        # Looks at 1, 3, 7 and 15 minutes: the last one past the grace.
        await env.sleep(LOOK_EVERY_S * 15 + 1)
        assert [started_all for _, started_all in calls.looks] == [False, False, False, True]
        assert LOOK_EVERY_S * 7 < START_GRACE_S < LOOK_EVERY_S * 15
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(only))
        assert (await handle.result()).state == BatchState.COMPLETED


async def test_cancel_tells_every_unfinished_job_and_counts_those_that_never_started(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    async with batch_worker(env.client, calls) as task_queue:
        handle, job_ids = await start_batch(env.client, task_queue, 4)
        calls.never_started = [job_ids[3]]
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(job_ids[0]))
        answer = await handle.execute_update(
            UPDATE_BATCH_CANCEL, {"reason": "enough"}, result_type=BatchStatus
        )
        assert answer.cancel_reason == "enough"
        # A second cancel changes nothing (the first reason holds).
        await handle.execute_update(UPDATE_BATCH_CANCEL, {"reason": "again"})
        cancelling = await _until(handle, lambda s: s.ended == 2)
        assert cancelling.state == BatchState.CANCELLING
        assert calls.cancelled == [(job_ids[1:], "enough")]
        for job_id in job_ids[1:3]:
            await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(job_id, state="CANCELLED"))
        final = await handle.result()
        assert final.state == BatchState.CANCELLED
        assert final.counts == {"COMPLETED": 1, "CANCELLED": 3}
        never = next(job for job in final.jobs if job.job_id == job_ids[3])
        assert never.error is not None and never.error.message == "enough"


async def test_its_one_webhook_is_retried_until_delivered_with_its_summary(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    calls.webhook_outcomes = ["retry", "retry", "delivered"]
    spec = WebhookSpec(url="https://example.invalid/hook", retry_horizon_s=600)
    async with batch_worker(env.client, calls) as task_queue:
        handle, [only] = await start_batch(env.client, task_queue, 1, webhook=spec)
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(only, state="FAILED"))
        final = await handle.result()
        assert final.webhook == "delivered"
        assert [w.attempt for w in calls.webhooks] == [1, 2, 3]
        assert len({w.webhook_id for w in calls.webhooks}) == 1
        sent = calls.webhooks[0]
        assert sent.entry is None and sent.event == "completed" and sent.tenant == "acme"
        assert sent.batch is not None and sent.batch["counts"] == {"FAILED": 1}
        assert "jobs" not in sent.batch


async def test_an_end_twice_or_of_another_batchs_job_counts_once_or_not_at_all(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    async with batch_worker(env.client, calls) as task_queue:
        handle, [first, second] = await start_batch(env.client, task_queue, 2)
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(first))
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(first, state="FAILED"))
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end("someone-else"))
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, {"not": "an end"})
        status = await _until(handle, lambda s: s.ended == 1)
        assert status.counts == {"COMPLETED": 1} and status.state == BatchState.RUNNING
        await handle.signal(SIGNAL_BATCH_JOB_ENDED, end(second))
        assert (await handle.result()).counts == {"COMPLETED": 2}


async def _until(handle: WorkflowHandle[Any, BatchStatus], check: Any) -> BatchStatus:
    for _ in range(200):
        status: BatchStatus = await handle.query(QUERY_BATCH_STATUS, result_type=BatchStatus)
        if check(status):
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"never; last {status}")
