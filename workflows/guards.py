"""The timers that end a job from outside its work: the deadline, abandonment, a queue wait.

Each waits on a durable timer and, when it fires, asks the job to stop with a typed reason;
the job's ordinary stop path does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts import JobPolicy, JobState
    from workflows.job_book import JobBook
    from workflows.shared import ErrorType

RequestStop = Callable[[JobState, str, str], None]


async def execution_deadline(policy: JobPolicy, stop: RequestStop) -> None:
    await workflow.sleep(
        timedelta(seconds=policy.execution_timeout_s), summary="execution deadline"
    )
    stop(
        JobState.FAILED,
        ErrorType.TIMEOUT,
        f"the job ran past execution_timeout_s ({policy.execution_timeout_s:.0f} s)",
    )


async def abandon_watchdog(abandon_after_s: float, book: JobBook, stop: RequestStop) -> None:
    """No client contact (a query does not count: it leaves no trace) for `abandon_after_s`."""
    while True:
        seen = book.contacts
        try:
            await workflow.wait_condition(
                lambda seen=seen: book.contacts != seen,  # type: ignore[misc]
                timeout=timedelta(seconds=abandon_after_s),
                timeout_summary="abandon watchdog",
            )
        except TimeoutError:
            stop(
                JobState.ABANDONED,
                ErrorType.ABANDONED,
                f"no client contact for {abandon_after_s:.0f} s",
            )
            return


async def queue_watchdog(queue_timeout_s: float, book: JobBook, stop: RequestStop) -> None:
    """A prompt that waits in the backend's queue longer than `queue_timeout_s` fails the job
    (`QueueTimeout`): the GPU it waits for is not coming in time."""
    while True:
        await workflow.wait_condition(lambda: book.backend_state == JobState.WAITING)
        waiting_for = book.prompt_id

        def moved_on(prompt: str | None = waiting_for) -> bool:
            return book.backend_state != JobState.WAITING or book.prompt_id != prompt

        try:
            await workflow.wait_condition(
                moved_on,
                timeout=timedelta(seconds=queue_timeout_s),
                timeout_summary="queue timeout",
            )
        except TimeoutError:
            position = book.status.progress.queue_position
            stop(
                JobState.FAILED,
                ErrorType.QUEUE_TIMEOUT,
                f"prompt {waiting_for} waited in the backend's queue (place {position}) "
                f"longer than queue_timeout_s ({queue_timeout_s:.0f} s)",
            )
            return
