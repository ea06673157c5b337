"""The webhook sender inside InferenceJob, on the time-skipping server with stand-in activities:
retries end at the event's horizon (hours pass in a moment), a 410 ends them at once, a Temporal
cancel after the job's end stops the deliveries, and the `ended` update answers at the job's
end while deliveries are still pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
import pytest_asyncio
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from starter import JobClient
from tests.support.workflow_fakes import GRAPH, FakeBackend, start_job
from workflows.activity_io import WebhookAttempt, WebhookDeliveryInput
from workflows.contracts import JobPolicy, JobRequest, JobState, JobStatus, WebhookSpec
from workflows.inference_job import InferenceJob
from workflows.shared import ACTIVITY_DELIVER_WEBHOOK, QUERY_STATUS, UPDATE_ENDED


class Receiver:
    """`deliver_webhook` answering `status` every time (200: delivered); with `answered`, only
    that many attempts are answered and later ones wait until they are cancelled."""

    def __init__(self, status: int, answered: int | None = None) -> None:
        self.status = status
        self.answered = answered
        self.attempts: Counter[str] = Counter()
        self.holding = asyncio.Event()  # an attempt is in flight, never to be answered

    @activity.defn(name=ACTIVITY_DELIVER_WEBHOOK)
    async def deliver_webhook(self, req: WebhookDeliveryInput) -> WebhookAttempt:
        self.attempts[req.webhook_id] += 1
        if self.answered is not None and sum(self.attempts.values()) > self.answered:
            self.holding.set()
            await asyncio.Future()  # never answers; the worker's shutdown cancels it
        now = activity.info().current_attempt_scheduled_time
        if self.status == 200:
            return WebhookAttempt(outcome="delivered", status_code=200, at=now)
        outcome: Any = "gone" if self.status == 410 else "retry"
        return WebhookAttempt(outcome=outcome, status_code=self.status, error="no", at=now)


@pytest_asyncio.fixture(loop_scope="session")
async def client(env: WorkflowEnvironment) -> AsyncIterator[Client]:
    yield env.client


async def job_with_webhook(
    client: Client, receiver: Receiver, horizon_s: float
) -> tuple[WebhookSpec, WorkflowHandle[Any, JobStatus], Worker]:
    task_queue = f"tq-{uuid.uuid4()}"
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[InferenceJob],
        activities=[*FakeBackend().activities(), receiver.deliver_webhook],
        graceful_shutdown_timeout=timedelta(seconds=1),
    )
    spec = WebhookSpec(url="https://hooks.example.com/h", retry_horizon_s=horizon_s)
    request = JobRequest(
        graph=GRAPH,
        policy=JobPolicy(abandon_after_s=None, heartbeat_timeout_s=1),
        webhook=spec,
    )
    return spec, await start_job(client, task_queue, request), worker


async def after_first_attempt(handle: WorkflowHandle[Any, JobStatus]) -> None:
    """Until the job's status counts the delivery's first attempt: the next one then waits on
    its retry timer or is in flight, never answered (`Receiver(answered=1)`).

    No attempt answers while the cancel lands: the time-skipping server was seen refusing the
    completion of a workflow task that asks to cancel an activity it already counts as done
    (ACTIVITY_UNKNOWN), and then never handing the workflow another task."""
    while True:
        status = await handle.query(QUERY_STATUS, result_type=JobStatus)
        if status.webhook is not None and any(d.attempts for d in status.webhook.deliveries):
            return
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def bounded(worker: Worker) -> AsyncIterator[list[str]]:
    """Runs `worker` for the block, which appends each step it waits on to the list it gets:
    60 s without the block's end fail the test naming the last one, instead of holding the
    suite (once in a fresh-clone CI run a test here sat idle for minutes; each passes in
    about 1 s)."""
    steps = ["the worker's start"]
    try:
        async with asyncio.timeout(60), worker:
            yield steps
            steps.append("the worker's shutdown")
    except TimeoutError:
        pytest.fail(f"no progress in 60 s, waiting on {steps[-1]}")


def given_up_by_the_cancel(status: JobStatus) -> None:
    assert status.webhook is not None
    assert (status.webhook.failed, status.webhook.pending) == (1, 0)
    assert "cancelled" in (status.webhook.deliveries[0].last_error or "")


async def final_status(handle: WorkflowHandle[Any, JobStatus]) -> JobStatus:
    try:
        await handle.result()
    except Exception:
        pass
    status: JobStatus = await handle.query(QUERY_STATUS, result_type=JobStatus)
    return status


async def test_an_event_is_retried_until_its_horizon_then_given_up(client: Client) -> None:
    receiver = Receiver(503)
    _, handle, worker = await job_with_webhook(client, receiver, horizon_s=3600.0)
    async with worker:
        status = await final_status(handle)
    assert status.state == JobState.COMPLETED
    webhook = status.webhook
    assert webhook is not None
    assert (webhook.delivered, webhook.failed, webhook.pending) == (0, 1, 0)
    [delivery] = webhook.deliveries
    assert delivery.state == "failed" and delivery.last_status_code == 503
    [(webhook_id, attempts)] = receiver.attempts.items()
    assert delivery.webhook_id == webhook_id and delivery.attempts == attempts
    # Backoff to a 6-minute ceiling (a tenth of the hour) with full jitter: about 20 attempts
    # in the hour, never one per second, never just a handful.
    assert 10 <= attempts <= 200


async def test_410_gone_gives_the_event_up_at_once(client: Client) -> None:
    receiver = Receiver(410)
    _, handle, worker = await job_with_webhook(client, receiver, horizon_s=3600.0)
    async with worker:
        status = await final_status(handle)
    assert status.webhook is not None and status.webhook.failed == 1
    assert list(receiver.attempts.values()) == [1]


async def test_ended_answers_at_the_end_and_a_temporal_cancel_stops_the_deliveries(
    client: Client,
) -> None:
    receiver = Receiver(503, answered=1)
    _, handle, worker = await job_with_webhook(client, receiver, horizon_s=24 * 3600.0)
    async with bounded(worker) as steps:
        steps.append("the `ended` update")
        ended = await handle.execute_update(UPDATE_ENDED, result_type=JobStatus)
        assert ended.state == JobState.COMPLETED
        assert ended.webhook is not None and ended.webhook.pending == 1
        steps.append("describe")
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        steps.append("a delivery attempt to end")
        await after_first_attempt(handle)
        steps.append("the cancel")
        await handle.cancel()
        steps.append("the result after the cancel")
        status = await final_status(handle)
    assert status.state == JobState.COMPLETED, "the job's own end is unchanged"
    given_up_by_the_cancel(status)
    assert sum(receiver.attempts.values()) <= 2
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


async def test_a_temporal_cancel_during_an_attempt_stops_the_deliveries(client: Client) -> None:
    """The SDK reports the cancelled attempt as the activity's error; the sender must not take
    it for a failed attempt and retry (it did: the workflow then ran on to the horizon)."""
    receiver = Receiver(503, answered=1)
    _, handle, worker = await job_with_webhook(client, receiver, horizon_s=24 * 3600.0)
    async with bounded(worker) as steps:
        steps.append("the second attempt")
        await receiver.holding.wait()
        steps.append("the cancel")
        await handle.cancel()
        steps.append("the result after the cancel")
        status = await final_status(handle)
    given_up_by_the_cancel(status)
    assert sum(receiver.attempts.values()) == 2, "no attempt after the cancel"
    assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED


async def test_wait_answers_through_runs_that_continue_as_new(client: Client) -> None:
    """The `ended` update asked of a run about to continue as new answers (not terminal) and
    is asked again of the next run, so `JobClient.wait` neither hangs nor blocks the job."""
    receiver = Receiver(200)
    task_queue = f"tq-{uuid.uuid4()}"
    request = JobRequest(
        graph=GRAPH,
        segments=[{}, {}, {}],
        policy=JobPolicy(abandon_after_s=None, heartbeat_timeout_s=1, history_budget_events=10),
        webhook=WebhookSpec(url="https://hooks.example.com/h", events=["completed"]),
    )
    handle = await start_job(client, task_queue, request)
    waiting = asyncio.create_task(JobClient(client, task_queue=task_queue).wait(handle.id))
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[InferenceJob],
        activities=[*FakeBackend().activities(), receiver.deliver_webhook],
        graceful_shutdown_timeout=timedelta(seconds=1),
    ):
        final = await waiting
        status = await final_status(handle)
    assert final.state == JobState.COMPLETED
    assert (await handle.describe()).run_id != handle.first_execution_run_id
    assert status.webhook is not None and status.webhook.delivered == 1
