"""`workflows/guards.py` on its own: which timer each guard starts, when it fires, what it says.

The guards only wait (`workflow.sleep`, `workflow.wait_condition`) and then ask for a stop. Here
each wait is a step of a script that checks the condition waited on and either lets it hold or
lets the timer fire; the stop requests are recorded word for word.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import workflow

from workflows import guards
from workflows.contracts import JobPolicy, JobState, JobStatus
from workflows.job_book import JobBook
from workflows.shared import ErrorType

Step = Callable[[Callable[[], bool]], None]


class Waits:
    """Plays `workflow.sleep` / `workflow.wait_condition` from a script of steps."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.calls: list[tuple[str, float | None, str | None]] = []

    async def sleep(self, duration: timedelta, *, summary: str | None = None) -> None:
        self.calls.append(("sleep", duration.total_seconds(), summary))

    async def wait_condition(
        self,
        fn: Callable[[], bool],
        *,
        timeout: timedelta | None = None,  # noqa: ASYNC109 (workflow.wait_condition's own)
        timeout_summary: str | None = None,
    ) -> None:
        seconds = timeout.total_seconds() if timeout is not None else None
        self.calls.append(("wait", seconds, timeout_summary))
        self.steps.pop(0)(fn)


def holds(fn: Callable[[], bool]) -> None:
    """The condition already holds: the wait returns at once."""
    assert fn()


def fires(fn: Callable[[], bool]) -> None:
    """The condition still does not hold: the timer fires."""
    assert not fn()
    raise TimeoutError


class Stops:
    def __init__(self) -> None:
        self.requests: list[tuple[JobState, str, str]] = []

    def __call__(self, state: JobState, error_type: str, message: str) -> None:
        self.requests.append((state, error_type, message))


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> JobBook:
    monkeypatch.setattr(workflow, "now", lambda: datetime(2026, 1, 1, tzinfo=UTC))
    return JobBook(JobStatus(job_id="j1"))


def _run(waits: Waits, monkeypatch: pytest.MonkeyPatch, guard: Any) -> None:
    monkeypatch.setattr(workflow, "sleep", waits.sleep)
    monkeypatch.setattr(workflow, "wait_condition", waits.wait_condition)
    asyncio.run(guard)
    assert waits.steps == []


def test_the_execution_deadline_fails_the_job_when_its_timer_fires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits, stop = Waits(), Stops()
    _run(waits, monkeypatch, guards.execution_deadline(JobPolicy(execution_timeout_s=90.4), stop))
    assert waits.calls == [("sleep", 90.4, "execution deadline")]
    assert stop.requests == [
        (JobState.FAILED, ErrorType.TIMEOUT, "the job ran past execution_timeout_s (90 s)")
    ]


def test_each_client_contact_restarts_the_abandon_watchdog(
    monkeypatch: pytest.MonkeyPatch, book: JobBook
) -> None:
    def contact(fn: Callable[[], bool]) -> None:
        assert not fn()
        book.contacts += 1
        assert fn()

    waits, stop = Waits(contact, contact, fires), Stops()
    _run(waits, monkeypatch, guards.abandon_watchdog(299.6, book, stop))
    assert waits.calls == [("wait", 299.6, "abandon watchdog")] * 3
    assert stop.requests == [
        (JobState.ABANDONED, ErrorType.ABANDONED, "no client contact for 300 s")
    ]


def test_a_prompt_waiting_past_the_queue_timeout_fails_the_job(
    monkeypatch: pytest.MonkeyPatch, book: JobBook
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

    waits, stop = Waits(queued("p-1"), moves_on, queued("p-1"), is_replaced, holds, fires), Stops()
    book.backend_state = JobState.RUNNING
    _run(waits, monkeypatch, guards.queue_watchdog(59.6, book, stop))
    waiting, timed = ("wait", None, None), ("wait", 59.6, "queue timeout")
    assert waits.calls == [waiting, timed] * 3
    assert stop.requests == [
        (
            JobState.FAILED,
            ErrorType.QUEUE_TIMEOUT,
            "prompt p-2 waited in the backend's queue (place 3) longer than queue_timeout_s (60 s)",
        )
    ]
