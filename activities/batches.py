"""The activities of a batch (workflows/job_batch.py): telling its unfinished jobs to stop, and
finding the jobs that ended without telling it (or never started)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Final

import structlog
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from workflows.batches import BatchJobEnd
from workflows.contracts import CancelRequest, JobError, JobState, JobStatus
from workflows.shared import (
    ACTIVITY_CANCEL_BATCH_JOBS,
    ACTIVITY_ENDED_BATCH_JOBS,
    QUERY_STATUS,
    SIGNAL_CANCEL,
    ErrorType,
)

log = structlog.get_logger(__name__)

# Calls to the server at once for one batch (signals, describes, queries).
_AT_ONCE: Final = 20

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
    def __init__(self, client: Client) -> None:
        self._client = client

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
                message="never started: the client that submitted the batch stopped before "
                "starting this job (submit the batch again, with the same ID, to start it)",
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
