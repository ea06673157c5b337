"""A job whose activity waits for a worker slot says so, without a server: descriptions built
from the proto the server answers (`PendingActivityInfo`, `PendingActivityState`), task queue
readings built by hand.

- `waiting_activity`: a job activity SCHEDULED (never started) for longer than the grace waits;
  one started, cancel-requested, paused, in its retry backoff, just scheduled, or a webhook's
  delivery does not;
- `worker_wait`: workers polling the queue lately (either kind of task) -> `slots_busy`; none,
  or none of the pinned job's version -> `no_worker`; an unreadable queue -> `unknown`; the
  backlog as the server counts it;
- `QueueReader`: one reading per task queue per TTL, shared by concurrent askers, a failure
  kept as None;
- `JobClient`: `status` and `watch` show the wait, and drop it once the activity starts; the
  task queue is read only while one waits;
- the CLI's line, the gateway's ETag and stream, and an old status payload without the field;
- the worker's HTTP pool and open-files limit sized to its slots.
"""

from __future__ import annotations

import asyncio
import resource
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import httpx
import pytest
import structlog
from temporalio.api.enums.v1 import (
    PendingActivityState,
    VersioningBehavior,
)
from temporalio.api.enums.v1 import WorkflowExecutionStatus as RawStatus
from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionResponse
from temporalio.client import Client, WorkflowExecutionDescription, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode

import worker
from gateway.feed import Cursor, _Sent
from gateway.views import etag
from starter import JobClient
from starter.cli.render import summary_lines
from starter.pollers import ActivityQueue, Poller
from starter.worker_wait import (
    GRACE_S,
    QueueReader,
    Scheduled,
    job_version,
    wait_line,
    waiting_activity,
    with_worker_wait,
    worker_wait,
)
from workflows.contracts import JobState, JobStatus, WorkerWait
from workflows.shared import (
    ACTIVITY_DELIVER_WEBHOOK,
    ACTIVITY_FOLLOW,
    ACTIVITY_PREPARE,
    ACTIVITY_STOP,
)

JOB = "job-wait"
QUEUE = "q-wait"
NOW = datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC)
SCHEDULED = PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED
STARTED = PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
CANCEL_REQUESTED = PendingActivityState.PENDING_ACTIVITY_STATE_CANCEL_REQUESTED
VERSION = ("durable-comfy", "1.0")


def raw(
    *pending: tuple[str, PendingActivityState.ValueType, float],
    pinned: tuple[str, str] | None = None,
    history_length: int = 10,
    status: RawStatus.ValueType = RawStatus.WORKFLOW_EXECUTION_STATUS_RUNNING,
    **changes: Any,
) -> DescribeWorkflowExecutionResponse:
    """The server's description: each pending activity's type, state and how many seconds
    before NOW it was scheduled; `changes` set fields of the last one (paused, ...)."""
    response = DescribeWorkflowExecutionResponse()
    info = response.workflow_execution_info
    info.execution.workflow_id, info.execution.run_id = JOB, "run-1"
    info.type.name = "InferenceJob"
    info.task_queue = QUEUE
    info.status = status
    info.history_length = history_length
    if pinned is not None:
        info.versioning_info.behavior = VersioningBehavior.VERSIONING_BEHAVIOR_PINNED
        info.versioning_info.deployment_version.deployment_name = pinned[0]
        info.versioning_info.deployment_version.build_id = pinned[1]
    for activity_type, state, ago_s in pending:
        activity = response.pending_activities.add()
        activity.activity_type.name = activity_type
        activity.state = state
        activity.attempt = 1
        activity.scheduled_time.FromDatetime(NOW - timedelta(seconds=ago_s))
        if state != SCHEDULED:
            activity.last_started_time.FromDatetime(NOW - timedelta(seconds=ago_s / 2))
    if pending:
        last = response.pending_activities[-1]
        for name, value in changes.items():
            if name == "next_attempt_in_s":
                last.next_attempt_schedule_time.FromDatetime(NOW + timedelta(seconds=value))
            else:
                setattr(last, name, value)
    return response


async def described(response: DescribeWorkflowExecutionResponse) -> WorkflowExecutionDescription:
    return await WorkflowExecutionDescription._from_raw_description(
        response, namespace="default", converter=pydantic_data_converter
    )


def poller(ago_s: float, version: tuple[str, str] | None = None) -> Poller:
    return Poller(
        identity=f"worker-{ago_s:g}",
        last_access=NOW - timedelta(seconds=ago_s),
        deployment_name=version[0] if version else None,
        build_id=version[1] if version else None,
    )


def queue(
    activity: list[Poller] | None = None,
    workflow: list[Poller] | None = None,
    backlog: int | None = 37,
) -> ActivityQueue:
    return ActivityQueue(
        task_queue=QUEUE,
        activity_pollers=activity or [],
        workflow_pollers=workflow or [],
        backlog=backlog,
    )


def status(state: JobState = JobState.SUBMITTING, seq: int = 5) -> JobStatus:
    return JobStatus(job_id=JOB, state=state, seq=seq)


# -- waiting_activity ---------------------------------------------------------------------------


@pytest.mark.parametrize("activity", [ACTIVITY_FOLLOW, ACTIVITY_PREPARE, ACTIVITY_STOP])
def test_a_job_activity_scheduled_past_the_grace_waits_for_a_worker(activity: str) -> None:
    found = waiting_activity(raw((activity, SCHEDULED, 5.0)), NOW)
    assert found == Scheduled(activity, NOW - timedelta(seconds=5))


@pytest.mark.parametrize(
    ("pending", "changes"),
    [
        ((ACTIVITY_FOLLOW, STARTED, 5.0), {}),  # a worker has it
        ((ACTIVITY_FOLLOW, CANCEL_REQUESTED, 5.0), {}),
        ((ACTIVITY_FOLLOW, SCHEDULED, GRACE_S / 2), {}),  # on its way to a worker right now
        ((ACTIVITY_FOLLOW, SCHEDULED, 5.0), {"paused": True}),
        ((ACTIVITY_PREPARE, SCHEDULED, 5.0), {"next_attempt_in_s": 3.0}),  # a retry's backoff
        ((ACTIVITY_DELIVER_WEBHOOK, SCHEDULED, 5.0), {}),  # beside the job, not in its way
    ],
)
def test_no_wait_is_reported_for(
    pending: tuple[str, PendingActivityState.ValueType, float], changes: dict[str, Any]
) -> None:
    assert waiting_activity(raw(pending, **changes), NOW) is None


def test_a_retry_waits_from_the_end_of_its_backoff() -> None:
    found = waiting_activity(raw((ACTIVITY_PREPARE, SCHEDULED, 9.0), next_attempt_in_s=-4.0), NOW)
    assert found is not None and found.since == NOW - timedelta(seconds=4)


def test_the_longest_wait_is_the_one_reported() -> None:
    found = waiting_activity(
        raw((ACTIVITY_STOP, SCHEDULED, 2.0), (ACTIVITY_FOLLOW, SCHEDULED, 8.0)), NOW
    )
    assert found == Scheduled(ACTIVITY_FOLLOW, NOW - timedelta(seconds=8))


def test_a_pinned_job_names_its_version() -> None:
    assert job_version(raw(pinned=VERSION)) == VERSION
    assert job_version(raw()) is None


# -- worker_wait: why --------------------------------------------------------------------------

WAITING = Scheduled(ACTIVITY_FOLLOW, NOW - timedelta(seconds=5))


@pytest.mark.parametrize(
    ("reading", "reason"),
    [
        (queue(activity=[poller(3)], workflow=[poller(3)]), "slots_busy"),
        # Every slot taken: the worker stopped polling for activity tasks minutes ago (and the
        # server forgets such a poller after 5 min) but still polls for workflow tasks.
        (queue(activity=[poller(200)], workflow=[poller(20)]), "slots_busy"),
        (queue(workflow=[poller(20)]), "slots_busy"),
        (queue(activity=[poller(200)], workflow=[poller(200)]), "no_worker"),  # gone
        (queue(), "no_worker"),
        (None, "unknown"),
    ],
)
def test_the_reason_comes_from_who_polls_the_task_queue(
    reading: ActivityQueue | None, reason: str
) -> None:
    wait = worker_wait(WAITING, reading, QUEUE, now=NOW)
    assert (wait.activity, wait.since, wait.reason) == (ACTIVITY_FOLLOW, WAITING.since, reason)
    assert wait.task_queue == QUEUE
    assert wait.backlog == (None if reading is None else 37)


def test_a_pinned_job_counts_only_the_workers_of_its_version() -> None:
    others = queue(workflow=[poller(3, ("durable-comfy", "2.0")), poller(3)])
    assert worker_wait(WAITING, others, QUEUE, VERSION, NOW).reason == "no_worker"
    own = queue(workflow=[poller(3, VERSION)])
    assert worker_wait(WAITING, own, QUEUE, VERSION, NOW).reason == "slots_busy"


def test_a_backlog_the_server_does_not_give_is_none() -> None:
    assert worker_wait(WAITING, queue(workflow=[poller(1)], backlog=None), QUEUE).backlog is None


# -- QueueReader ----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_task_queue_is_read_once_per_ttl_and_a_failure_is_kept_as_none() -> None:
    reads: list[str] = []
    fail = False

    async def read(task_queue: str) -> ActivityQueue:
        reads.append(task_queue)
        if fail:
            raise RPCError("denied", RPCStatusCode.PERMISSION_DENIED, b"")
        return queue(workflow=[poller(1)])

    clock = Clock()
    reader = QueueReader(read, ttl_s=2.0, clock=clock)
    first = await reader.get(QUEUE)
    assert first is not None and await reader.get(QUEUE) is first
    await reader.get("other")
    assert reads == [QUEUE, "other"]
    clock.now += 2.5
    fail = True
    assert await reader.get(QUEUE) is None
    assert await reader.get(QUEUE) is None
    assert reads == [QUEUE, "other", QUEUE], "the failure is kept for the TTL too"


async def test_concurrent_askers_share_one_reading() -> None:
    released = asyncio.Event()
    reads = 0

    async def read(task_queue: str) -> ActivityQueue:
        nonlocal reads
        reads += 1
        await released.wait()
        return queue()

    reader = QueueReader(read)
    askers = [asyncio.create_task(reader.get(QUEUE)) for _ in range(5)]
    await asyncio.sleep(0)
    askers[0].cancel()  # one watch closed: the others still get their answer
    released.set()
    answers = await asyncio.gather(*askers[1:])
    assert reads == 1 and all(a is answers[0] for a in answers)


# -- with_worker_wait and JobClient ---------------------------------------------------------------


class FakeReader(QueueReader):
    """A reader that counts its reads and answers `reading`."""

    def __init__(self, reading: ActivityQueue | None) -> None:
        self.reading = reading
        self.reads = 0

    async def get(self, task_queue: str) -> ActivityQueue | None:
        self.reads += 1
        return self.reading


async def test_a_status_shows_the_wait_and_reads_the_queue_only_then() -> None:
    reader = FakeReader(queue(workflow=[poller(1)]))
    waiting = await described(raw((ACTIVITY_FOLLOW, SCHEDULED, 5.0)))
    shown = await with_worker_wait(status(), waiting, reader, NOW)
    assert shown.worker_wait == WorkerWait(
        activity=ACTIVITY_FOLLOW,
        since=NOW - timedelta(seconds=5),
        reason="slots_busy",
        task_queue=QUEUE,
        backlog=37,
    )
    assert shown.seq == 5, "the job's own answer is otherwise unchanged"
    started = await described(raw((ACTIVITY_FOLLOW, STARTED, 5.0)))
    assert (
        await with_worker_wait(status(JobState.RUNNING), started, reader, NOW)
    ).worker_wait is None
    assert reader.reads == 1, "the task queue is read only while an activity waits"


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.NEEDS_DECISION, JobState.COMPLETED])
async def test_a_job_in_no_activity_state_is_left_alone(state: JobState) -> None:
    reader = FakeReader(queue())
    waiting = await described(raw((ACTIVITY_FOLLOW, SCHEDULED, 5.0)))
    assert await with_worker_wait(status(state), waiting, reader, NOW) == status(state)
    assert reader.reads == 0


# A poller without a time counts as live whatever the clock says.
LIVE = Poller(identity="worker-live", last_access=None)


class Scripted:
    """A JobClient whose query and describe are scripted (the clock: the real one, so each
    description is built relative to now); a closed workflow's record is the last answer."""

    def __init__(self, answers: list[JobStatus], descriptions: list[WorkflowExecutionDescription]):
        self.client = JobClient(cast(Client, object()))
        self.reader = FakeReader(queue(workflow=[LIVE]))
        self.client.queues = self.reader

        async def query(job_id: str) -> JobStatus:
            return answers.pop(0) if len(answers) > 1 else answers[0]

        async def describe(job_id: str) -> WorkflowExecutionDescription:
            return descriptions.pop(0) if len(descriptions) > 1 else descriptions[0]

        async def client_seen(job_id: str) -> None:
            return None

        async def recorded_end(
            job_id: str, description: WorkflowExecutionDescription
        ) -> JobStatus | None:
            closed = description.status != WorkflowExecutionStatus.RUNNING
            return answers[-1] if closed else None

        self.client._query = query  # type: ignore[method-assign]
        self.client._describe = describe  # type: ignore[method-assign]
        self.client._client_seen = client_seen  # type: ignore[method-assign]
        self.client._recorded_end = recorded_end  # type: ignore[method-assign]


def now_raw(
    *pending: tuple[str, PendingActivityState.ValueType, float], at: datetime, **kw: Any
) -> Any:
    """`raw`, with the times relative to `at` (the real clock when the test began: the client
    compares with it, and an activity's scheduled time is the same in every description)."""
    response = raw(*pending, **kw)
    shift = at - NOW
    for activity in response.pending_activities:
        activity.scheduled_time.FromDatetime(activity.scheduled_time.ToDatetime(UTC) + shift)
    return response


async def test_status_reports_the_wait() -> None:
    at = datetime.now(UTC)
    scripted = Scripted(
        [status()], [await described(now_raw((ACTIVITY_FOLLOW, SCHEDULED, 5.0), at=at))]
    )
    shown = await scripted.client.status(JOB)
    assert shown.worker_wait is not None and shown.worker_wait.reason == "slots_busy"


async def test_watch_yields_the_wait_appearing_changing_and_gone() -> None:
    at = datetime.now(UTC)
    done = status(JobState.COMPLETED, seq=9)
    preparing = status(JobState.PREPARING, seq=3)
    scripted = Scripted(
        [preparing, status(JobState.RUNNING, seq=6), done],
        [
            await described(now_raw((ACTIVITY_PREPARE, SCHEDULED, 0.1), history_length=10, at=at)),
            await described(now_raw((ACTIVITY_PREPARE, SCHEDULED, 5.0), history_length=10, at=at)),
            await described(now_raw((ACTIVITY_PREPARE, SCHEDULED, 5.0), history_length=10, at=at)),
            await described(now_raw((ACTIVITY_PREPARE, SCHEDULED, 5.0), history_length=10, at=at)),
            await described(now_raw((ACTIVITY_FOLLOW, STARTED, 1.0), history_length=20, at=at)),
            await described(
                now_raw(
                    history_length=30,
                    status=RawStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED,
                    at=at,
                )
            ),
        ],
    )
    seen: list[tuple[str, str | None, int | None]] = []
    async with asyncio.timeout(10):
        async for shown in scripted.client.watch(JOB, poll_interval_s=0, keepalive_s=3600):
            wait = shown.worker_wait
            if wait is None:
                seen.append((shown.state, None, None))
            else:
                seen.append((shown.state, wait.reason, wait.backlog))
            if len(seen) == 2:
                scripted.reader.reading = queue(workflow=[LIVE], backlog=12)
    assert seen == [
        (JobState.PREPARING, None, None),  # scheduled a moment ago: within the grace
        (JobState.PREPARING, "slots_busy", 37),  # the same seq: yielded for the wait alone
        (JobState.PREPARING, "slots_busy", 12),  # the backlog moved
        (JobState.RUNNING, None, None),  # started: the wait is gone
        (JobState.COMPLETED, None, None),
    ]


# -- what people, the gateway and old payloads see -----------------------------------------------


def wait(**changes: Any) -> WorkerWait:
    base: dict[str, Any] = {
        "activity": ACTIVITY_FOLLOW,
        "since": datetime(2026, 1, 1, 12, 0, 1, tzinfo=UTC),
        "reason": "slots_busy",
        "task_queue": "durable-comfy",
        "backlog": 37,
    }
    return WorkerWait.model_validate(base | changes)


def test_the_cli_says_it_in_one_line() -> None:
    assert wait_line(wait()) == (
        "waiting for a worker slot since 12:00:01 UTC "
        "(every slot busy; 37 task(s) waiting on 'durable-comfy')"
    )
    assert wait_line(wait(backlog=None)).endswith("(every slot busy)")
    assert wait_line(wait(reason="no_worker")) == (
        "waiting for a worker since 12:00:01 UTC: no worker polls task queue 'durable-comfy' "
        "(start one: durable-comfy worker)"
    )
    shown = status().model_copy(update={"worker_wait": wait()})
    assert wait_line(wait()) in summary_lines(shown)
    assert not any("waiting for a worker" in line for line in summary_lines(status()))


def test_the_gateway_tag_changes_with_the_wait_and_its_stream_sends_it() -> None:
    plain = status()
    waiting = plain.model_copy(update={"worker_wait": wait()})
    moved = plain.model_copy(update={"worker_wait": wait(backlog=36)})
    assert len({etag(plain), etag(waiting), etag(moved)}) == 3
    sent = _Sent(Cursor(plain.seq), status=(plain.seq, 0))
    assert sent.news(waiting) and not sent.news(plain)
    sent.wait = waiting.worker_wait
    assert sent.news(moved) and sent.news(plain) and not sent.news(waiting)


def test_a_status_without_the_field_still_validates() -> None:
    payload = status().model_dump(mode="json")
    del payload["worker_wait"]
    assert JobStatus.model_validate(payload).worker_wait is None


# -- the worker's pool and open files --------------------------------------------------------------


def test_the_http_pool_fits_the_slots() -> None:
    limits = worker.http_limits(1000)
    assert isinstance(limits, httpx.Limits)
    assert limits.max_connections is not None and limits.max_connections > 1000
    assert limits.max_keepalive_connections == 200
    assert worker.http_limits(10).max_keepalive_connections == 20


@pytest.mark.parametrize(
    ("soft", "hard", "raised_to", "warned"),
    [
        (1024, 4096, 4096, False),  # 1,000 slots need 2,256: raised to the hard limit
        (1024, 524288, 524288, False),
        (4096, 524288, None, False),  # enough already
        (1024, 1500, 1500, True),  # the hard limit is too low: raised, and said
        (1024, resource.RLIM_INFINITY, 2256, False),
    ],
)
def test_the_open_files_limit_is_raised_to_fit_the_slots(
    monkeypatch: pytest.MonkeyPatch,
    soft: int,
    hard: int,
    raised_to: int | None,
    warned: bool,
) -> None:
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: set_to.append(limits))
    assert worker.open_files_needed(1000) == 2256
    with structlog.testing.capture_logs() as logs:
        worker.raise_open_files_limit(1000)
    assert set_to == ([] if raised_to is None else [(raised_to, hard)])
    low = [entry for entry in logs if entry["event"] == "open_files_limit_low"]
    assert bool(low) == warned
    if warned:
        assert (low[0]["limit"], low[0]["needed"], low[0]["slots"]) == (1500, 2256, 1000)
