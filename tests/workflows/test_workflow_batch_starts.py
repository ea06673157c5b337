"""A batch whose workflow starts its own jobs (`BatchInput.jobs`), on the time-skipping server:
the real `start_batch_jobs` activity (activities/batches.py) with a start of the test's, real
jobs (`InferenceJob` on the fake backend) telling their batch; a start attempt lost half-way goes
on from its last heartbeat; a cancel while starting stops the starts first, so every job that
exists is told to stop and none starts after."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.batches import STARTS_AT_ONCE, BatchActivities
from tests.support.workflow_fakes import FakeBackend, Script, job_worker, request
from tests.workflows.test_workflow_job_batch import Calls
from workflows.batches import BatchInput, BatchJobs, BatchState, BatchStatus, compact_jobs
from workflows.contracts import JobRequest
from workflows.job_batch import JobBatch
from workflows.job_input import JobInput
from workflows.shared import (
    ACTIVITY_CANCEL_BATCH_JOBS,
    BATCH_LABEL,
    BATCH_WORKFLOW_TYPE,
    QUERY_BATCH_STATUS,
    UPDATE_BATCH_CANCEL,
    WORKFLOW_TYPE,
)

Start = Callable[[JobRequest, str, bool], Awaitable[str]]


class Starts:
    """A batch job start of the test's: each job's workflow on `job_queue`, every call
    recorded; `before` runs first (a test's fault or hold)."""

    def __init__(self, client: Client, job_queue: str) -> None:
        self.client, self.job_queue = client, job_queue
        self.calls: list[str] = []
        self.started: list[tuple[str, int]] = []  # (job ID, the request's width)
        self.before: Callable[[str], Awaitable[None]] | None = None

    async def __call__(self, request: JobRequest, job_id: str, detached: bool) -> str:
        self.calls.append(job_id)
        if self.before is not None:
            await self.before(job_id)
        try:
            await self.client.start_workflow(
                WORKFLOW_TYPE, JobInput(request=request), id=job_id, task_queue=self.job_queue
            )
        except WorkflowAlreadyStartedError:
            return "existed"
        self.started.append((job_id, request.graph["1"]["inputs"]["width"]))
        return "started"


@contextlib.asynccontextmanager
async def batch_worker(client: Client, calls: Calls, start: Start) -> AsyncIterator[str]:
    task_queue = f"batch-{uuid.uuid4()}"
    real = BatchActivities(client, start)
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[JobBatch],
        activities=[
            calls.cancel_batch_jobs,
            calls.ended_batch_jobs,
            calls.deliver_webhook,
            real.start_batch_jobs,
        ],
        graceful_shutdown_timeout=timedelta(seconds=1),
        # Heartbeats sent at once, not every 16 s: a cancel is heard at the next chunk's.
        max_heartbeat_throttle_interval=timedelta(seconds=0.1),
    ):
        yield task_queue


def in_short(batch_id: str, widths: list[int]) -> BatchJobs:
    """Jobs that differ in one input (the image's width), labelled with their batch."""
    template = request().model_copy(update={"labels": {BATCH_LABEL: batch_id}})
    requests = []
    for width in widths:
        graph = {**template.graph, "1": {**template.graph["1"]}}
        graph["1"]["inputs"] = {**graph["1"]["inputs"], "width": width}
        requests.append(template.model_copy(update={"graph": graph}))
    jobs = compact_jobs(requests, detached=True)
    assert jobs is not None
    return jobs


async def start_batch(
    client: Client, task_queue: str, widths: list[int]
) -> tuple[WorkflowHandle[Any, BatchStatus], list[str]]:
    batch_id = f"batch-{uuid.uuid4().hex[:8]}"
    job_ids = [f"{batch_id}-{n:04d}" for n in range(1, len(widths) + 1)]
    handle = await client.start_workflow(
        BATCH_WORKFLOW_TYPE,
        BatchInput(
            batch_id=batch_id, job_ids=job_ids, tenant="acme", jobs=in_short(batch_id, widths)
        ),
        id=batch_id,
        task_queue=task_queue,
        result_type=BatchStatus,
    )
    return handle, job_ids


async def test_the_batch_starts_its_jobs_each_as_sent_and_ends_when_they_have(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    async with job_worker(env.client, FakeBackend(Script())) as job_queue:
        starts = Starts(env.client, job_queue)
        async with batch_worker(env.client, calls, starts) as batch_queue:
            widths = [64 + 8 * n for n in range(STARTS_AT_ONCE + 3)]
            handle, job_ids = await start_batch(env.client, batch_queue, widths)
            final = await asyncio.wait_for(handle.result(), timeout=60)
    assert final.state == BatchState.COMPLETED
    assert final.counts == {"COMPLETED": len(widths)}
    # Each job once, under its ID, with its own inputs (the widths are in order).
    assert sorted(starts.started) == sorted(zip(job_ids, widths, strict=True))
    assert Counter(starts.calls) == Counter(job_ids)


async def test_a_start_lost_half_way_goes_on_from_its_last_heartbeat(
    env: WorkflowEnvironment,
) -> None:
    calls = Calls()
    async with job_worker(env.client, FakeBackend(Script())) as job_queue:
        starts = Starts(env.client, job_queue)
        widths = [64] * (2 * STARTS_AT_ONCE + 5)
        failed: list[str] = []

        async def fail_once_in_the_second_chunk(job_id: str) -> None:
            if job_id.endswith(f"-{STARTS_AT_ONCE + 3:04d}") and not failed:
                failed.append(job_id)
                raise RuntimeError("the server is unreachable")

        starts.before = fail_once_in_the_second_chunk
        async with batch_worker(env.client, calls, starts) as batch_queue:
            handle, job_ids = await start_batch(env.client, batch_queue, widths)
            final = await asyncio.wait_for(handle.result(), timeout=60)
    assert failed and final.counts == {"COMPLETED": len(widths)}
    asked = Counter(starts.calls)
    # The first chunk (heartbeated) was not asked again; the second was, the rest once.
    assert all(asked[job_id] == 1 for job_id in job_ids[:STARTS_AT_ONCE]), asked
    assert all(asked[job_id] == 2 for job_id in job_ids[STARTS_AT_ONCE : 2 * STARTS_AT_ONCE])
    assert all(asked[job_id] == 1 for job_id in job_ids[2 * STARTS_AT_ONCE :])
    assert sorted(job_id for job_id, _ in starts.started) == job_ids


class CancelCalls(Calls):
    """The cancel of the batch's jobs as the real one answers: the jobs it finds no workflow
    for never started. What had started when it was called is kept."""

    def __init__(self, starts: Starts) -> None:
        super().__init__()
        self.starts = starts
        self.started_when_cancelled: list[str] | None = None

    @activity.defn(name=ACTIVITY_CANCEL_BATCH_JOBS)
    async def cancel_batch_jobs(self, job_ids: list[str], reason: str) -> list[str]:
        self.cancelled.append((job_ids, reason))
        started = [job_id for job_id, _ in self.starts.started]
        self.started_when_cancelled = started
        return [job_id for job_id in job_ids if job_id not in started]


async def test_a_cancel_while_starting_stops_the_starts_then_every_job_that_exists(
    env: WorkflowEnvironment,
) -> None:
    async with job_worker(env.client, FakeBackend(Script())) as job_queue:
        starts = Starts(env.client, job_queue)
        calls = CancelCalls(starts)
        held = asyncio.Event()
        release = asyncio.Event()
        widths = [64] * (3 * STARTS_AT_ONCE)

        async def hold_the_second_chunk(job_id: str) -> None:
            number = int(job_id.rsplit("-", 1)[1])
            if number > STARTS_AT_ONCE:
                held.set()
                await release.wait()

        starts.before = hold_the_second_chunk
        async with batch_worker(env.client, calls, starts) as batch_queue:
            handle, job_ids = await start_batch(env.client, batch_queue, widths)
            try:
                await asyncio.wait_for(held.wait(), timeout=30)
                await handle.execute_update(UPDATE_BATCH_CANCEL, {"reason": "enough"})
                # The starts in flight end before the jobs are told: nothing is told yet.
                await asyncio.sleep(0.5)
                status = await handle.query(QUERY_BATCH_STATUS, result_type=BatchStatus)
                assert status.state == BatchState.CANCELLING and not calls.cancelled
            finally:
                release.set()  # the worker's shutdown waits for the held starts
            final = await asyncio.wait_for(handle.result(), timeout=60)
    assert final.state == BatchState.CANCELLED and final.ended == len(job_ids)
    [(_told, reason)] = calls.cancelled
    assert reason == "enough"
    # No job started after the jobs were told (it would run on, unheard by the cancel)...
    assert calls.started_when_cancelled == [job_id for job_id, _ in starts.started]
    # ...and the second chunk, in flight at the cancel, was started whole first.
    assert len(starts.started) >= 2 * STARTS_AT_ONCE
    never = set(job_ids) - {job_id for job_id, _ in starts.started}
    assert final.counts.get("CANCELLED", 0) == len(never)
