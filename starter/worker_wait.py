"""Whether a job waits for a worker: one of its activities scheduled, and not started.

A running job holds one activity slot of a worker for its whole follow
(`WorkerSettings.max_concurrent_activities`). An activity that finds every slot of every worker
taken, or no worker polling, waits in the task queue, and the job's own answer cannot say so:
its workflow only knows it scheduled the activity (its state stays PREPARING or SUBMITTING).
Temporal's record does. The workflow's description lists the activity as pending, in state
SCHEDULED since its scheduled time; the task queue's description says who polls it and how many
activity tasks wait on it (`starter.pollers.activity_queue`).

`waiting_activity` finds such an activity (scheduled for longer than `GRACE_S`, so a task being
handed to a worker right now is not reported; a retry waiting out its backoff is not either);
`worker_wait` says why it waits; `QueueReader` reads the task queue at most once per
`QUEUE_TTL_S` per task queue, and only when an activity waits. `with_worker_wait` lays the
result over a status as `JobStatus.worker_wait` (the workflow never sets it).

Why: workers that poll the queue lately (either kind of task: a worker whose activity slots are
all taken stops polling for activity tasks, not for workflow tasks) mean every slot is busy
(`slots_busy`); none means nothing will start it (`no_worker`). For a job pinned to a Worker
Deployment Version only that version's workers count, since only they get its activities.

The job's place in line is not knowable: the server splits a task queue into partitions, each
dispatching its own backlog, and the backlog counts every job's activity tasks. So the backlog
is reported as the server counts it (approximate), and the job is one of those.

The grace compares the client's clock with the server's scheduled time: a client clock behind
the server's reports a wait that much later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from temporalio.api.enums.v1 import PendingActivityState, VersioningBehavior
from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionResponse
from temporalio.client import RPCTimeoutOrCancelledError, WorkflowExecutionDescription
from temporalio.service import RPCError

from starter.pollers import ActivityQueue, live_pollers
from starter.progress import FOLLOW_STATES
from workflows.contracts import JobState, JobStatus, WorkerWait
from workflows.shared import ACTIVITY_FOLLOW, ACTIVITY_OFFLOAD, ACTIVITY_PREPARE, ACTIVITY_STOP

# An activity scheduled this recently may be on its way to a worker: not reported yet.
GRACE_S = 1.0
# How long one reading of a task queue serves every job on it.
QUEUE_TTL_S = 2.0
# Task queues whose last reading is kept (the oldest forgotten first).
MAX_QUEUES = 1000
# The job's own activities (a webhook's delivery runs beside the job, not in its way).
JOB_ACTIVITIES = frozenset({ACTIVITY_PREPARE, ACTIVITY_FOLLOW, ACTIVITY_OFFLOAD, ACTIVITY_STOP})
# The states in which one of them may be scheduled: where a watch reads the description on
# every poll (the heartbeat's step, and a wait).
WAIT_STATES = FOLLOW_STATES | {JobState.PREPARING, JobState.STOPPING}


@dataclass(frozen=True)
class Scheduled:
    """A job's activity that no worker has started: its type, and since when it waits."""

    activity: str
    since: datetime


def waiting_activity(
    raw: DescribeWorkflowExecutionResponse, now: datetime, grace_s: float = GRACE_S
) -> Scheduled | None:
    """The job's activity that has waited longest for a worker (longer than `grace_s`), if any."""
    found: Scheduled | None = None
    for pending in raw.pending_activities:
        name = pending.activity_type.name
        if name not in JOB_ACTIVITIES or pending.paused:
            continue
        if pending.state != PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED:
            continue
        if not pending.HasField("scheduled_time"):
            continue
        since = pending.scheduled_time.ToDatetime(tzinfo=UTC)
        if pending.HasField("next_attempt_schedule_time"):
            # A retry is handed out once its backoff is over, not before.
            since = max(since, pending.next_attempt_schedule_time.ToDatetime(tzinfo=UTC))
        if (now - since).total_seconds() < grace_s:
            continue
        if found is None or since < found.since:
            found = Scheduled(name, since)
    return found


def job_version(raw: DescribeWorkflowExecutionResponse) -> tuple[str, str] | None:
    """The Worker Deployment Version a pinned job runs on (deployment, build ID); None when
    any worker of the queue may take its activities."""
    info = raw.workflow_execution_info
    if not info.HasField("versioning_info"):
        return None
    versioning = info.versioning_info
    if versioning.behavior != VersioningBehavior.VERSIONING_BEHAVIOR_PINNED:
        return None
    version = versioning.deployment_version
    if not version.build_id:
        return None
    return version.deployment_name, version.build_id


def worker_wait(
    scheduled: Scheduled,
    queue: ActivityQueue | None,
    task_queue: str,
    version: tuple[str, str] | None = None,
    now: datetime | None = None,
) -> WorkerWait:
    """Why `scheduled` waits, from the task queue's reading (None: it could not be read)."""
    if queue is None:
        reason = "unknown"
    else:
        pollers = live_pollers([*queue.activity_pollers, *queue.workflow_pollers], now)
        if version is not None:
            pollers = [p for p in pollers if (p.deployment_name, p.build_id) == version]
        reason = "slots_busy" if pollers else "no_worker"
    return WorkerWait(
        activity=scheduled.activity,
        since=scheduled.since,
        reason=reason,
        task_queue=task_queue,
        backlog=None if queue is None else queue.backlog,
    )


class QueueReader:
    """Reads task queues for waiting jobs: each at most once per `ttl_s` (one reading, or one
    failure, serves every job on the queue meanwhile; concurrent askers share one call). A
    failed reading is None: advisory, never the reason a status fails."""

    def __init__(
        self,
        read: Callable[[str], Awaitable[ActivityQueue]],
        ttl_s: float = QUEUE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._ttl_s = ttl_s
        self._clock = clock
        self._kept: dict[str, tuple[float, ActivityQueue | None]] = {}
        self._reading: dict[str, asyncio.Task[ActivityQueue | None]] = {}

    async def get(self, task_queue: str) -> ActivityQueue | None:
        kept = self._kept.get(task_queue)
        if kept is not None and self._clock() - kept[0] < self._ttl_s:
            return kept[1]
        reading = self._reading.get(task_queue)
        if reading is None:
            reading = self._reading[task_queue] = asyncio.create_task(self._fresh(task_queue))
        # Shielded: one asker cancelled (its watch closed) does not cancel the others' reading.
        return await asyncio.shield(reading)

    async def _fresh(self, task_queue: str) -> ActivityQueue | None:
        try:
            queue: ActivityQueue | None = await self._read(task_queue)
        except (RPCError, RPCTimeoutOrCancelledError, RuntimeError):
            queue = None
        finally:
            self._reading.pop(task_queue, None)
        self._kept.pop(task_queue, None)
        self._kept[task_queue] = (self._clock(), queue)
        while len(self._kept) > MAX_QUEUES:
            del self._kept[next(iter(self._kept))]
        return queue


async def with_worker_wait(
    status: JobStatus,
    description: WorkflowExecutionDescription,
    queues: QueueReader,
    now: datetime | None = None,
) -> JobStatus:
    """`status` with `worker_wait` set when one of its activities waits for a worker (as the
    description shows it), else as it is."""
    if status.state not in WAIT_STATES:
        return status
    now = now or datetime.now(UTC)
    raw = description.raw_description
    scheduled = waiting_activity(raw, now)
    if scheduled is None:
        return status
    task_queue = description.task_queue
    queue = await queues.get(task_queue)
    wait = worker_wait(scheduled, queue, task_queue, job_version(raw), now)
    return status.model_copy(update={"worker_wait": wait})


def wait_line(wait: WorkerWait) -> str:
    """One line for people: what the job waits for, since when, and how many wait with it."""
    since = wait.since.astimezone(UTC).strftime("%H:%M:%S UTC")
    queue = repr(wait.task_queue)
    if wait.reason == "no_worker":
        return (
            f"waiting for a worker since {since}: no worker polls task queue {queue} "
            "(start one: durable-comfy worker)"
        )
    if wait.reason == "unknown":
        return f"waiting for a worker since {since} (task queue {queue} could not be read)"
    waiting = "" if not wait.backlog else f"; {wait.backlog} task(s) waiting on {queue}"
    return f"waiting for a worker slot since {since} (every slot busy{waiting})"
