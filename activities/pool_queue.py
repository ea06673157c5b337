"""The activities of a bounded pool's queue (workflows/pool_queue.py): starting its dispatcher,
and finding the holders whose job closed without giving its slot back."""

from __future__ import annotations

import asyncio

import structlog
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.orphans import OrphanSweeper
from workflows.admission import QueueState, SlotRequest
from workflows.shared import (
    ACTIVITY_CLOSED_JOBS,
    ACTIVITY_OPEN_POOL_QUEUE,
    POOL_QUEUE_WORKFLOW_TYPE,
    SIGNAL_SLOT_REQUEST,
    pool_queue_id,
)

log = structlog.get_logger(__name__)

# Holders described at once (each a call to the server).
_DESCRIBE_AT_ONCE = 20


class PoolQueueActivities:
    def __init__(self, client: Client, sweeper: OrphanSweeper) -> None:
        self._client = client
        self._sweeper = sweeper

    @activity.defn(name=ACTIVITY_OPEN_POOL_QUEUE)
    async def open_pool_queue(self, pool: str, request: SlotRequest) -> None:
        """Signal-with-start: the pool's dispatcher gets the request, started first if none
        runs (its first job, or one terminated by an operator)."""
        await self.ask(pool, request)
        log.info("pool_queue_opened", pool=pool, job_id=request.job_id)

    async def ask(self, pool: str, request: SlotRequest) -> None:
        """The request, by signal-with-start, from inside an activity of the job's task queue
        (the check asks for the job's slot at once: activities/backend.py)."""
        task_queue = activity.info().task_queue
        await self._client.start_workflow(
            POOL_QUEUE_WORKFLOW_TYPE,
            QueueState(pool=pool),
            id=pool_queue_id(task_queue, pool),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=SIGNAL_SLOT_REQUEST,
            start_signal_args=[request],
        )

    @activity.defn(name=ACTIVITY_CLOSED_JOBS)
    async def closed_jobs(self, pool: str, job_ids: list[str]) -> list[str]:
        """The jobs among `job_ids` whose slot is free: their workflow is closed or unknown,
        and nothing of theirs is left on the pool (the orphan sweep stops what is, and the slot
        comes back at the next look after it has)."""
        gate = asyncio.Semaphore(_DESCRIBE_AT_ONCE)

        async def closed(job_id: str) -> bool:
            async with gate:
                try:
                    described = await self._client.get_workflow_handle(job_id).describe()
                except RPCError as err:
                    if err.status == RPCStatusCode.NOT_FOUND:
                        return True
                    raise
            return described.status != WorkflowExecutionStatus.RUNNING

        found = await asyncio.gather(*(closed(job_id) for job_id in job_ids))
        gone = [job_id for job_id, is_closed in zip(job_ids, found, strict=True) if is_closed]
        if gone:
            left = await self._sweeper.work_left(pool, set(gone))
            for job_id in sorted(left):
                log.info("pool_slot_kept_until_swept", pool=pool, job_id=job_id)
            gone = [job_id for job_id in gone if job_id not in left]
        for job_id in gone:
            log.warning("pool_slot_reclaimed", pool=pool, job_id=job_id)
        return gone
