"""The activities of a bounded pool's queue (workflows/pool_queue.py): starting its dispatcher,
and finding the holders whose job closed without giving its slot back."""

from __future__ import annotations

import asyncio
import random
import time
from datetime import timedelta
from typing import Any

import structlog
from temporalio import activity
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.orphans import OrphanSweeper
from workflows.admission import (
    Admission,
    PoolHealthView,
    QueueState,
    SlotRelease,
    SlotRequest,
)
from workflows.shared import (
    ACTIVITY_CLOSED_JOBS,
    ACTIVITY_OPEN_POOL_QUEUE,
    POOL_QUEUE_WORKFLOW_TYPE,
    QUERY_POOL_HEALTH,
    SIGNAL_SLOT_RELEASE,
    SIGNAL_SLOT_REQUEST,
    UPDATE_SLOT_ASK,
    pool_queue_id,
)

log = structlog.get_logger(__name__)

# Holders described at once (each a call to the server).
_DESCRIBE_AT_ONCE = 20
# How long a check keeps asking a dispatcher that has too many updates in flight (the server
# takes 10 at once per workflow by default, `history.maxInFlightUpdates`) before it falls back to
# the signal; at most half the activity's heartbeat timeout (a follow that checks heartbeats
# only once it follows).
_ASK_BUSY_FOR_S = 10.0
# What the server answers an update it cannot take now: too many in flight, or aborted (the run
# closed under it, as at a continue-as-new).
_BUSY = (RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.UNAVAILABLE)
# The same, for a check that waits in line itself (activities/slot_watch.py).
_ASK_IN_FOLLOW_BUSY_FOR_S = 0.5
# How long a group's check waits for a pool's queue to say whether it takes work.
_HEALTH_TIMEOUT = timedelta(seconds=5)
# Asks one worker has in flight to one dispatcher: under the server's limit of updates in flight,
# so that a burst of checks queues here (a few ms each) rather than backs off from refusals.
_ASK_AT_ONCE = 5


class PoolQueueActivities:
    def __init__(self, client: Client, sweeper: OrphanSweeper) -> None:
        self._client = client
        self._sweeper = sweeper
        self._asking: dict[tuple[str, str], asyncio.Semaphore] = {}

    @activity.defn(name=ACTIVITY_OPEN_POOL_QUEUE)
    async def open_pool_queue(self, pool: str, request: SlotRequest) -> None:
        """Signal-with-start: the pool's dispatcher gets the request, started first if none
        runs (its first job, or one terminated by an operator)."""
        await self._request(pool, request)
        log.info("pool_queue_opened", pool=pool, job_id=request.job_id)

    async def ask(self, pool: str, request: SlotRequest) -> Admission | None:
        """The request from inside an activity of the job's task queue (the check asks for
        the job's slot at once: activities/backend.py), by update-with-start: the queue's
        answer, the grant or a place in line, comes back here and goes to the job with the
        check's result. None when the queue took the request by signal instead (a dispatcher
        of a version without the update, or too busy to take one): its answer reaches the job
        by signal."""
        info = activity.info()
        patience = _ASK_BUSY_FOR_S
        if info.heartbeat_timeout:
            patience = min(patience, info.heartbeat_timeout.total_seconds() / 2)
        if request.in_follow:
            # Its follow watches the queue for its place and grant: an answer by update only
            # saves a look, so a burst of checks goes by signal (cheaper for the queue) at once.
            patience = min(patience, _ASK_IN_FOLLOW_BUSY_FOR_S)
        return await self.ask_on(info.task_queue, pool, request, patience_s=patience)

    async def ask_on(
        self, task_queue: str, pool: str, request: SlotRequest, *, patience_s: float | None = None
    ) -> Admission | None:
        """`ask`, for the dispatcher of `task_queue`, waiting at most `patience_s` for it."""
        patience = _ASK_BUSY_FOR_S if patience_s is None else patience_s
        gate = self._asking.setdefault((task_queue, pool), asyncio.Semaphore(_ASK_AT_ONCE))
        give_up_at = time.monotonic() + patience
        try:
            await asyncio.wait_for(gate.acquire(), timeout=patience)
        except TimeoutError:
            # A burst larger than the dispatcher answers in that time: the rest by signal.
            log.info("pool_slot_asked_by_signal", pool=pool, job_id=request.job_id, why="busy")
            await self.request_on(task_queue, pool, request)
            return None
        try:
            return await self._ask_on(task_queue, pool, request, give_up_at)
        finally:
            gate.release()

    async def _ask_on(
        self, task_queue: str, pool: str, request: SlotRequest, give_up_at: float
    ) -> Admission | None:
        pause = 0.02
        while True:
            # A start operation serves one call: a new one for each.
            start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
                POOL_QUEUE_WORKFLOW_TYPE,
                QueueState(pool=pool),
                id=pool_queue_id(task_queue, pool),
                task_queue=task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            )
            try:
                answer: Admission = await self._client.execute_update_with_start_workflow(
                    UPDATE_SLOT_ASK,
                    request,
                    start_workflow_operation=start,
                    result_type=Admission,
                )
                return answer
            except WorkflowUpdateFailedError as refused:
                # An older dispatcher (no `ask`) or a refused payload.
                why = str(refused)
            except RPCError as exc:
                if exc.status not in _BUSY:
                    raise
                if time.monotonic() + pause < give_up_at:
                    # Many checks asking at once, or the run closing (continue-as-new): again
                    # shortly, spread out.
                    await asyncio.sleep(random.uniform(pause / 2, pause))
                    pause = min(pause * 2, 0.25)
                    continue
                why = exc.message
            log.info("pool_slot_asked_by_signal", pool=pool, job_id=request.job_id, why=why)
            await self.request_on(task_queue, pool, request)
            return None

    async def release(self, pool: str, release: SlotRelease) -> bool:
        """The job's slot back, from the activity that saw its prompt end; False when the
        signal did not go (the job then gives it back itself)."""
        queue = pool_queue_id(activity.info().task_queue, pool)
        try:
            await self._client.get_workflow_handle(queue).signal(SIGNAL_SLOT_RELEASE, release)
        except RPCError as exc:
            log.warning(
                "pool_slot_release_not_sent", pool=pool, job_id=release.job_id, error=exc.message
            )
            return False
        return True

    async def health(self, pool: str) -> PoolHealthView | None:
        """Whether the pool's queue takes work, and a new job's wait there (a group's check);
        None when no queue runs for it (an unbounded pool, or none of its jobs asked yet) or it
        cannot be asked now: nothing then says it is unwell."""
        queue = pool_queue_id(activity.info().task_queue, pool)
        try:
            view: PoolHealthView = await self._client.get_workflow_handle(queue).query(
                QUERY_POOL_HEALTH, result_type=PoolHealthView, rpc_timeout=_HEALTH_TIMEOUT
            )
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:
                log.warning("pool_health_unread", pool=pool, error=exc.message)
            return None
        except WorkflowQueryFailedError as exc:
            log.warning("pool_health_unread", pool=pool, error=str(exc))
            return None
        return view

    async def _request(self, pool: str, request: SlotRequest) -> None:
        await self.request_on(activity.info().task_queue, pool, request)

    async def request_on(self, task_queue: str, pool: str, request: SlotRequest) -> None:
        """Signal-with-start: the `request` signal, the dispatcher started first if none runs
        (its first job, or one terminated by an operator)."""
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
        # The dispatcher says which of them still held a slot (one may have released it since
        # the sweep listed it): it logs `pool_slot_reclaimed` for those.
        log.debug("pool_slot_holders_closed", pool=pool, job_ids=gone)
        return gone
