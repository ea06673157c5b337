"""The guards of workflows/stopping.py on their own: which timer each starts, when it fires,
what it says.

The guards only wait (`workflow.sleep`, `workflow.wait_condition`) and then ask for a stop. Here
each wait is a step of a script that checks the condition waited on and either lets it hold or
lets the timer fire; the stop requests are recorded word for word.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from tests.support.workflow_fakes import FakeWorkflow, Step, fires, holds
from workflows.contracts import JobPolicy, JobState, JobStatus, ProgressReport
from workflows.job_book import JobBook, StopOrder
from workflows.shared import ErrorType
from workflows.stopping import (
    TimeInLine,
    abandon_watchdog,
    execution_deadline,
    queue_watchdog,
    start_deadline,
)


class Stops:
    def __init__(self) -> None:
        self.requests: list[tuple[JobState, str, str]] = []

    def __call__(self, order: StopOrder) -> None:
        assert order.error is not None and not order.via_temporal
        self.requests.append((order.state, order.error.type, order.error.message))


@pytest.fixture
def book(wf: FakeWorkflow) -> JobBook:
    return JobBook(JobStatus(job_id="j1"))


def _run(wf: FakeWorkflow, guard: Any) -> None:
    asyncio.run(guard)
    assert wf.conditions == [], "the guard waited fewer times than the script says"


def test_the_execution_deadline_fails_the_job_when_its_timer_fires(wf: FakeWorkflow) -> None:
    stop = Stops()
    _run(wf, execution_deadline(JobPolicy(execution_timeout_s=90.4), stop))
    assert wf.sleeps == [(90.4, "execution deadline")] and wf.waits == []
    assert stop.requests == [
        (JobState.FAILED, ErrorType.TIMEOUT, "the job ran past execution_timeout_s (90 s)")
    ]


def test_each_client_contact_restarts_the_abandon_watchdog(wf: FakeWorkflow, book: JobBook) -> None:
    def contact(fn: Callable[[], bool]) -> None:
        assert not fn()
        book.contacts += 1
        assert fn()

    wf.conditions, stop = [contact, contact, fires], Stops()
    _run(wf, abandon_watchdog(299.6, book, stop))
    assert wf.waits == [(299.6, "abandon watchdog")] * 3
    assert stop.requests == [
        (JobState.ABANDONED, ErrorType.ABANDONED, "no client contact for 300 s")
    ]


def test_a_prompt_waiting_past_the_queue_timeout_fails_the_job(
    wf: FakeWorkflow, book: JobBook
) -> None:
    def queued(prompt: str) -> Step:
        def step(fn: Callable[[], bool]) -> None:
            assert not fn()  # running, or a new prompt not yet heard of
            book.backend_state, book.prompt_id = JobState.WAITING, prompt
            book.status.progress.queue_position = 3
            assert fn()

        return step

    def moves_on(fn: Callable[[], bool]) -> None:
        assert not fn()
        book.backend_state = JobState.RUNNING
        assert fn()

    def is_replaced(fn: Callable[[], bool]) -> None:
        assert not fn()
        book.prompt_id = "p-2"  # resubmitted: the new prompt waits again, its own timer
        assert fn()

    wf.conditions = [queued("p-1"), moves_on, queued("p-1"), is_replaced, holds, fires]
    stop = Stops()
    book.backend_state = JobState.RUNNING
    _run(wf, queue_watchdog(59.6, book, stop))
    waiting, timed = (None, None), (59.6, "queue timeout")
    assert wf.waits == [waiting, timed] * 3 and wf.sleeps == []
    assert stop.requests == [
        (
            JobState.FAILED,
            ErrorType.QUEUE_TIMEOUT,
            "prompt p-2 waited in the backend's queue (place 3) longer than queue_timeout_s (60 s)",
        )
    ]


def test_a_job_not_begun_to_run_by_start_by_s_expires(wf: FakeWorkflow, book: JobBook) -> None:
    book.status.created_at = wf.now
    wf.advance(20.0)  # the job was accepted 20 s before this run's guards started
    book.status.state = JobState.PENDING
    wf.conditions = [fires]
    stop = Stops()
    _run(wf, start_deadline(60.0, book, stop))
    # Counted from acceptance: 40 s are left, not 60.
    assert wf.waits == [(40.0, "start deadline")]
    assert stop.requests == [
        (
            JobState.EXPIRED,
            ErrorType.EXPIRED,
            "not begun to run within start_by_s (60 s): still PENDING",
        )
    ]


def test_a_job_whose_prompt_began_to_run_does_not_expire(wf: FakeWorkflow, book: JobBook) -> None:
    book.status.created_at = wf.now

    def begins(fn: Callable[[], bool]) -> None:
        assert not fn()
        report = ProgressReport(attempt_client_id="c1", stage="running", step=1)
        book.apply_progress(report, stage_changes=True)
        assert fn()

    wf.conditions = [begins]
    stop = Stops()
    _run(wf, start_deadline(60.0, book, stop))
    assert stop.requests == []


def test_time_pending_in_line_is_added_to_the_execution_deadline(wf: FakeWorkflow) -> None:
    """The timer runs from the start; when it fires it sleeps the time the job waited in our
    queue, and a job still waiting there when it fires is not stopped before its grant."""
    line, stop = TimeInLine(), Stops()
    line.waits()
    wf.now += timedelta(seconds=30)
    line.granted()
    line.waits()  # a second wait (a run that continued, say) still going when the timer fires

    def granted_after_12_s(fn: Callable[[], bool]) -> None:
        assert not fn()
        wf.now += timedelta(seconds=12)
        line.granted()
        assert fn()

    wf.conditions = [granted_after_12_s]
    _run(wf, execution_deadline(JobPolicy(execution_timeout_s=90.4), stop, line))
    assert wf.sleeps == [
        (90.4, "execution deadline"),
        # 30 s in line, then the second wait: the timer's 90.4 s and 12 s after it.
        (30 + 90.4 + 12, "execution deadline (time in line)"),
    ]
    assert wf.waits == [(None, None)]
    assert stop.requests == [
        (JobState.FAILED, ErrorType.TIMEOUT, "the job ran past execution_timeout_s (90 s)")
    ]


def test_a_job_that_never_waited_in_line_stops_when_its_timer_fires(wf: FakeWorkflow) -> None:
    stop = Stops()
    _run(wf, execution_deadline(JobPolicy(execution_timeout_s=10.0), stop, TimeInLine()))
    assert wf.sleeps == [(10.0, "execution deadline")] and len(stop.requests) == 1
