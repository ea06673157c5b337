"""Who polls a task queue: the workers that could run a job's workflow tasks.

A job whose task queue nobody polls waits silently: its status query goes unanswered and its
first workflow task sits in the queue. Temporal knows which workers polled the queue lately
(DescribeTaskQueue), so a watcher can say so in seconds instead of timing out on a query.

The server keeps a poller listed for a few minutes after its last poll; an idle worker polls
again about every minute (a long poll). `live_pollers` keeps those seen within `LIVE_WITHIN_S`,
so a worker stopped minutes ago does not count as one that polls.

A worker whose activity slots are all taken stops polling for activity tasks (the SDK takes a
slot before it polls) while it goes on polling for workflow tasks: `activity_queue` reads both
kinds of pollers, and the activity tasks waiting on the queue (`approximate_backlog_count`), in
two DescribeTaskQueue calls (`starter.worker_wait` asks only when a job's activity waits).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta

import temporalio.client
from pydantic import BaseModel
from temporalio.api.enums.v1 import TaskQueueKind, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import (
    DescribeTaskQueueRequest,
    DescribeTaskQueueResponse,
)
from temporalio.service import RPCError

from workflows.shared import LIVE_IN_IDENTITY

# Longer than a long poll (the server answers an empty one after about 60 s, the SDK allows 70)
# so an idle worker between two polls still counts.
LIVE_WITHIN_S = 90.0


class Poller(BaseModel):
    """A worker that polled the task queue, as the server last saw it."""

    identity: str
    last_access: datetime | None
    # Where the worker pushes live progress, from its identity (None: it pushes none).
    live: str | None = None
    # The Worker Deployment Version it polls as (None: an unversioned worker).
    deployment_name: str | None = None
    build_id: str | None = None


class ActivityQueue(BaseModel):
    """A task queue as a job whose activity waits needs it: who polls it, for either kind of
    task, and how many activity tasks wait on it (the server's approximate count; None when it
    does not say)."""

    task_queue: str
    activity_pollers: list[Poller]
    workflow_pollers: list[Poller]
    backlog: int | None


async def workflow_pollers(client: temporalio.client.Client, task_queue: str) -> list[Poller]:
    """The pollers of `task_queue`'s workflow tasks the server remembers (recent and not)."""
    response = await _describe(client, task_queue, TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW)
    return _pollers(response)


async def activity_queue(client: temporalio.client.Client, task_queue: str) -> ActivityQueue:
    """`task_queue`'s pollers of both kinds, and its activity backlog (two calls)."""
    activities = await _describe(
        client, task_queue, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY, report_stats=True
    )
    workflows = await _describe(client, task_queue, TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW)
    return ActivityQueue(
        task_queue=task_queue,
        activity_pollers=_pollers(activities),
        workflow_pollers=_pollers(workflows),
        backlog=(
            int(activities.stats.approximate_backlog_count)
            if activities.HasField("stats")
            else None
        ),
    )


async def _describe(
    client: temporalio.client.Client,
    task_queue: str,
    kind: TaskQueueType.ValueType,
    *,
    report_stats: bool = False,
) -> DescribeTaskQueueResponse:
    return await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue, kind=TaskQueueKind.TASK_QUEUE_KIND_NORMAL),
            task_queue_type=kind,
            report_stats=report_stats,
        )
    )


def split_identity(identity: str) -> tuple[str, str | None]:
    """A poller's identity as its worker gave it (`activities.live_progress.poller_identity`):
    the worker's own, and where it pushes live progress (None: nowhere)."""
    own, mark, live = identity.partition(LIVE_IN_IDENTITY)
    return (own, live) if mark and live else (identity, None)


def _pollers(response: DescribeTaskQueueResponse) -> list[Poller]:
    return [
        Poller(
            identity=split_identity(poller.identity)[0],
            live=split_identity(poller.identity)[1],
            last_access=(
                poller.last_access_time.ToDatetime(tzinfo=UTC)
                if poller.HasField("last_access_time")
                else None
            ),
            deployment_name=(
                poller.deployment_options.deployment_name
                if poller.HasField("deployment_options")
                else None
            ),
            build_id=(
                poller.deployment_options.build_id
                if poller.HasField("deployment_options")
                else None
            ),
        )
        for poller in response.pollers
    ]


def live_pollers(
    pollers: Iterable[Poller], now: datetime | None = None, within_s: float = LIVE_WITHIN_S
) -> list[Poller]:
    """Those that polled within `within_s` (one without a time is taken as live)."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=within_s)
    return [p for p in pollers if p.last_access is None or p.last_access >= cutoff]


class Presence(BaseModel):
    """Whether a worker polls the task queue, and which, when that changes."""

    task_queue: str
    polled: bool
    identities: list[str] = []


async def presence_changes(
    client: temporalio.client.Client,
    task_queue: str,
    *,
    first_after_s: float = 1.0,
    every_s: float = 2.0,
) -> AsyncIterator[Presence]:
    """Yield the task queue's presence first when nobody polls it, then on each change.

    Nothing while workers poll from the start: a watcher only needs telling when something is
    wrong, and again when it is put right. A failed describe is skipped (advisory: the watch
    itself reports Temporal being unreachable)."""
    await asyncio.sleep(first_after_s)
    polled: bool | None = None
    while True:
        try:
            live = live_pollers(await workflow_pollers(client, task_queue))
        except RPCError:
            live = None
        if live is not None:
            now_polled = bool(live)
            if now_polled != polled and (polled is not None or not now_polled):
                yield Presence(
                    task_queue=task_queue,
                    polled=now_polled,
                    identities=sorted({p.identity for p in live}),
                )
            polled = now_polled
        await asyncio.sleep(every_s)
