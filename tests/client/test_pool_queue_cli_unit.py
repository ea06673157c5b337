"""The queue as the CLI shows it: a PENDING job's place in words, and `pool queue`'s table."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from temporalio.client import WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from starter.cli.common import ExitCode, exit_code_for
from starter.cli.pools import queue_lines
from starter.cli.render import summary_lines
from starter.errors import QueueFull
from starter.queues import ROOM_ATTEMPTS, RoomCheck, queue_room
from workflows.admission import Admission, PoolQueueView, QueueEntry, QueueRoom, place_in_line
from workflows.contracts import JobState, JobStatus

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("position", "said"),
    [
        (1, "1st"),
        (2, "2nd"),
        (3, "3rd"),
        (4, "4th"),
        (11, "11th"),
        (12, "12th"),
        (13, "13th"),
        (21, "21st"),
        (22, "22nd"),
        (111, "111th"),
        (123, "123rd"),
    ],
)
def test_a_place_in_line_reads_as_an_ordinal(position: int, said: str) -> None:
    admission = Admission(pool="gpu", position=position, waiting=200)
    assert place_in_line(admission) == f"{said} of 200 for pool gpu"


def test_a_job_in_line_before_the_queue_told_its_place_says_so() -> None:
    unplaced = Admission(pool="gpu")
    assert place_in_line(unplaced) == "in line for pool gpu, its place not known yet"


def test_the_wait_is_said_in_seconds_minutes_or_hours() -> None:
    assert place_in_line(Admission(pool="gpu", position=12, waiting=40, eta_s=180.0)) == (
        "12th of 40 for pool gpu, about 3 min"
    )
    assert place_in_line(Admission(pool="gpu", position=1, waiting=1, eta_s=42.0)).endswith(
        "about 42 s"
    )
    assert place_in_line(Admission(pool="gpu", position=1, waiting=9, eta_s=7200.0)).endswith(
        "about 2.0 h"
    )


def test_a_pending_jobs_summary_says_where_it_stands() -> None:
    status = JobStatus(
        job_id="j1",
        state=JobState.PENDING,
        admission=Admission(pool="gpu", position=12, waiting=40, eta_s=180.0),
    )
    assert "12th of 40 for pool gpu, about 3 min" in summary_lines(status)[0]


def test_pool_queue_lists_the_line_in_order_then_the_holders() -> None:
    view = PoolQueueView(
        pool="gpu",
        max_running=2,
        running=2,
        waiting=2,
        entries=[
            QueueEntry(
                job_id="j-3",
                tenant="acme",
                priority=1,
                state="waiting",
                position=1,
                since=NOW - timedelta(seconds=5),
            ),
            QueueEntry(
                job_id="j-4",
                tenant="beta",
                priority=3,
                state="waiting",
                position=2,
                since=NOW - timedelta(seconds=65),
            ),
            QueueEntry(
                job_id="j-1",
                tenant="acme",
                priority=3,
                state="running",
                since=NOW - timedelta(seconds=300),
            ),
            QueueEntry(
                job_id="j-2",
                tenant="beta",
                priority=3,
                state="unsettled",
                since=NOW - timedelta(seconds=900),
                detail="teardown UNCONFIRMED: ...",
            ),
        ],
    )
    lines = queue_lines(view, NOW)
    assert lines[0] == "pool gpu: 2 running, 2 waiting (max_running 2)"
    assert lines[1].split() == ["position", "job", "tenant", "priority", "state", "age"]
    assert [line.split() for line in lines[2:]] == [
        ["1", "j-3", "acme", "1", "waiting", "5s"],
        ["2", "j-4", "beta", "3", "waiting", "65s"],
        ["j-1", "acme", "3", "running", "300s"],
        ["j-2", "beta", "3", "unsettled", "900s"],
    ]


def test_queue_full_exits_5_and_says_when_to_try_again() -> None:
    refused = QueueFull("gpu", "acme", "tenant 'acme' has 2 jobs waiting", 2.3)
    assert exit_code_for(refused) == ExitCode.QUEUE_FULL and int(ExitCode.QUEUE_FULL) == 5
    assert str(refused) == (
        "queue full: tenant 'acme' has 2 jobs waiting; nothing was started, try again in about 3 s"
    )


class _FlakyQueue:
    """A queue handle whose worker fails `failures` queries before it answers `room` (or whose
    server refuses them: `busy`, too many queries buffered for a busy workflow)."""

    def __init__(self, failures: int, room: QueueRoom, *, busy: bool = False) -> None:
        self.failures, self.room, self.asked, self.busy = failures, room, 0, busy

    def get_workflow_handle(self, workflow_id: str) -> _FlakyQueue:
        return self

    async def query(self, name: str, arg: object, *, result_type: object) -> QueueRoom:
        self.asked += 1
        await asyncio.sleep(0.01)
        if self.asked <= self.failures:
            if self.busy:
                raise RPCError(
                    "consistent query buffer is full", RPCStatusCode.RESOURCE_EXHAUSTED, b""
                )
            raise WorkflowQueryFailedError("[TMPRL1101] Potential deadlock detected")
        return self.room


async def test_the_room_check_asks_a_queue_that_failed_to_answer_again() -> None:
    full = QueueRoom(full=True, reason="pool 'gpu' has 1 jobs waiting", limit=1)
    queue = _FlakyQueue(2, full)
    room = await queue_room(queue, "tq", "gpu", "acme")  # type: ignore[arg-type]
    assert room.full and queue.asked == 3
    # A queue that never answers does not block submissions: the check is advisory.
    silent = _FlakyQueue(10, full)
    assert not (await queue_room(silent, "tq", "gpu", "acme")).full  # type: ignore[arg-type]
    assert silent.asked == ROOM_ATTEMPTS


async def test_a_busy_queue_refusing_the_query_is_asked_again_then_let_through() -> None:
    full = QueueRoom(full=True, reason="pool 'gpu' has 1 jobs waiting", limit=1)
    queue = _FlakyQueue(1, full, busy=True)
    assert (await queue_room(queue, "tq", "gpu", "acme")).full  # type: ignore[arg-type]
    assert queue.asked == 2
    silent = _FlakyQueue(10, full, busy=True)
    assert not (await queue_room(silent, "tq", "gpu", "acme")).full  # type: ignore[arg-type]


async def test_many_submissions_at_once_ask_the_queue_once_within_the_headroom() -> None:
    queue = _FlakyQueue(0, QueueRoom(waiting=10, headroom=40))
    rooms = RoomCheck(queue, "tq")  # type: ignore[arg-type]
    answers = await asyncio.gather(*(rooms.join("gpu", "acme") for _ in range(40)))
    assert not any(room.full for room in answers)
    assert queue.asked == 1, "one query for 40 joins that fit the headroom"
    # The 41st is past what the queue said would fit: it asks again.
    queue.room = QueueRoom(full=True, reason="pool 'gpu' has 50 jobs waiting", limit=50)
    assert (await rooms.join("gpu", "acme")).full and queue.asked == 2
    # A full answer is never trusted for the next join; another tenant asks for itself.
    assert (await rooms.join("gpu", "acme")).full and queue.asked == 3
    queue.room = QueueRoom(waiting=0, headroom=5)
    assert not (await rooms.join("gpu", "other")).full and queue.asked == 4


async def test_a_queue_that_did_not_say_its_headroom_is_asked_at_every_join() -> None:
    queue = _FlakyQueue(0, QueueRoom(waiting=10))
    rooms = RoomCheck(queue, "tq")  # type: ignore[arg-type]
    await asyncio.gather(*(rooms.join("gpu", "acme") for _ in range(3)))
    assert queue.asked == 3
