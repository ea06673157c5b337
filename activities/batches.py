"""The activities of a batch (workflows/job_batch.py): starting its jobs, telling its unfinished
jobs to stop, and finding the jobs that ended without telling it (or never started)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Final

import structlog
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from workflows.batches import BatchJobEnd, BatchJobs, batch_job_id
from workflows.contracts import CancelRequest, JobError, JobRequest, JobState, JobStatus
from workflows.shared import (
    ACTIVITY_CANCEL_BATCH_JOBS,
    ACTIVITY_ENDED_BATCH_JOBS,
    ACTIVITY_START_BATCH_JOBS,
    QUERY_STATUS,
    SIGNAL_CANCEL,
    ErrorType,
)

log = structlog.get_logger(__name__)

# Calls to the server at once for one batch (signals, describes, queries).
_AT_ONCE: Final = 20
# Jobs started at once, and between two heartbeats (what a resumed start may repeat): as many as
# a client's submission starts at once (starter/batches.py).
STARTS_AT_ONCE: Final = 32

# Starts one job of a batch: its request as checked (not yet detached), its ID, whether it runs
# detached -> "started", "existed" (the same request under the ID), or "not started: <why>"
# for a job that never can be (another request holds the ID). Errors that may pass (the
# server unreachable) raise. The worker gives the client's (starter/batches.py): this module
# starts workflows as every client does, without importing the client.
StartBatchJob = Callable[[JobRequest, str, bool], Awaitable[str]]

# How Temporal's own record names an ending the job never ran (it cannot have told its batch).
_FROM_OUTSIDE: Final = {
    WorkflowExecutionStatus.TERMINATED: (
        JobState.TERMINATED,
        "Terminated",
        "terminated from outside: teardown did not run",
    ),
    WorkflowExecutionStatus.TIMED_OUT: (
        JobState.TIMED_OUT,
        "TimedOut",
        "timed out by a Temporal timeout set from outside: teardown did not run",
    ),
}
_RECORDED: Final = {
    WorkflowExecutionStatus.COMPLETED: JobState.COMPLETED,
    WorkflowExecutionStatus.FAILED: JobState.FAILED,
    WorkflowExecutionStatus.CANCELED: JobState.CANCELLED,
}


class BatchActivities:
    def __init__(self, client: Client, start_job: StartBatchJob | None = None) -> None:
        self._client = client
        self._start_job = start_job

    @activity.defn(name=ACTIVITY_START_BATCH_JOBS)
    async def start_batch_jobs(self, batch_id: str, jobs: BatchJobs) -> int:
        """Start every job of the batch, `STARTS_AT_ONCE` at a time, from where the last attempt
        heartbeated; how many this attempt started (the others existed). Cancelled, it returns
        only once no start is in flight: the batch's cancel that follows finds every job."""
        if self._start_job is None:
            raise ApplicationError("this worker was given no way to start jobs")
        details = activity.info().heartbeat_details
        done = int(details[0]) if details else 0
        total = len(jobs.inputs)
        started = 0
        while done < total:
            chunk = range(done, min(done + STARTS_AT_ONCE, total))
            starts = asyncio.gather(*(self._start_one(batch_id, jobs, i) for i in chunk))
            try:
                started += sum(await asyncio.shield(starts))
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await starts
                raise
            done = chunk.stop
            activity.heartbeat(done)
        log.info("batch_jobs_started", batch_id=batch_id, jobs=total, started=started)
        return started

    async def _start_one(self, batch_id: str, jobs: BatchJobs, index: int) -> bool:
        assert self._start_job is not None
        job_id = batch_job_id(batch_id, index)
        outcome = await self._start_job(jobs.request(index), job_id, jobs.detached)
        if outcome not in ("started", "existed"):
            log.warning("batch_job_not_started", batch_id=batch_id, job_id=job_id, why=outcome)
        return outcome == "started"

    @activity.defn(name=ACTIVITY_CANCEL_BATCH_JOBS)
    async def cancel_batch_jobs(self, job_ids: list[str], reason: str) -> list[str]:
        """Send each job its `cancel` (the same stop as one cancelled job's); the IDs of those
        that never started (no workflow at all), which the batch records as cancelled."""
        gate = asyncio.Semaphore(_AT_ONCE)

        async def cancel(job_id: str) -> bool:
            async with gate:
                handle = self._client.get_workflow_handle(job_id)
                try:
                    await handle.signal(SIGNAL_CANCEL, CancelRequest(reason=reason))
                    return False
                except RPCError as err:
                    if err.status != RPCStatusCode.NOT_FOUND:
                        raise
                # Ended already (it tells the batch itself), or never started.
                return await self._describe(job_id) is None

        missing = await asyncio.gather(*(cancel(job_id) for job_id in job_ids))
        never = [job_id for job_id, gone in zip(job_ids, missing, strict=True) if gone]
        log.info("batch_jobs_cancelled", told=len(job_ids) - len(never), never_started=len(never))
        return never

    @activity.defn(name=ACTIVITY_ENDED_BATCH_JOBS)
    async def ended_batch_jobs(
        self, batch_id: str, unheard: list[str], started_all: bool
    ) -> list[BatchJobEnd]:
        """Among `unheard`, the jobs that have ended (their workflow closed) and, once the
        batch's client is done starting (`started_all`), those that never started. One list
        call of the visibility store finds them; only those are read one by one."""
        wanted = set(unheard)
        running: set[str] = set()
        closed: dict[str, WorkflowExecutionStatus] = {}
        query = f'WorkflowId STARTS_WITH "{batch_id}-"'
        async for execution in self._client.list_workflows(query, page_size=1000):
            job_id = execution.id
            if job_id not in wanted or execution.status is None:
                continue
            if execution.status == WorkflowExecutionStatus.RUNNING:
                running.add(job_id)
            elif execution.status != WorkflowExecutionStatus.CONTINUED_AS_NEW:
                closed[job_id] = execution.status
        for job_id in running:
            closed.pop(job_id, None)  # an earlier run closed; the job runs on
        candidates = list(closed)
        if started_all:
            candidates += [job_id for job_id in unheard if job_id not in running | set(closed)]
        gate = asyncio.Semaphore(_AT_ONCE)

        async def read(job_id: str) -> BatchJobEnd | None:
            async with gate:
                return await self._end_of(job_id)

        found = [end for end in await asyncio.gather(*map(read, candidates)) if end is not None]
        if found:
            log.info("batch_jobs_found_ended", batch_id=batch_id, jobs=len(found))
        return found

    async def _describe(self, job_id: str) -> WorkflowExecutionDescription | None:
        try:
            return await self._client.get_workflow_handle(job_id).describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return None
            raise

    async def _end_of(self, job_id: str) -> BatchJobEnd | None:
        """The job's end as Temporal and the job record it (None: it runs after all)."""
        now = datetime.now(UTC)
        description = await self._describe(job_id)
        if description is None:
            error = JobError(
                type=ErrorType.NEVER_STARTED,
                message="never started: the batch's submission stopped before starting this "
                "job, or another request holds its ID (submit the batch again, with the same ID, "
                "to start what is missing)",
            )
            return BatchJobEnd(
                job_id=job_id, state=JobState.FAILED, error=error, ended_at=now, source="found"
            )
        status = description.status
        if status in (None, WorkflowExecutionStatus.RUNNING):
            return None
        at = description.close_time or now
        if status in _FROM_OUTSIDE:
            state, error_type, message = _FROM_OUTSIDE[status]
            error = JobError(type=error_type, message=message)
            return BatchJobEnd(job_id=job_id, state=state, error=error, ended_at=at, source="found")
        try:
            job = await self._client.get_workflow_handle(job_id).query(
                QUERY_STATUS, result_type=JobStatus
            )
        except Exception as exc:  # no worker answers: Temporal's word is all there is
            log.warning("batch_job_unread", job_id=job_id, error=str(exc)[:200])
            state = _RECORDED.get(status, JobState.FAILED)
            return BatchJobEnd(job_id=job_id, state=state, ended_at=at, source="found")
        end = BatchJobEnd.of(job, at)
        if not job.terminal:
            end.state = _RECORDED.get(status, JobState.FAILED)
        end.source = "found"
        return end
