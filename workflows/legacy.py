"""How jobs started before v3 ("submit-in-follow-confirmed-stop") submit and stop.

Those runs scheduled a submit activity of its own before following, and stopped a prompt with
one teardown call (plus an early one at the moment of a stop, from "interrupt-on-stop"). Jobs
still running from then replay through here; new runs never come this way. Delete this module
once no such run can be open (check with `temporal workflow list`).
"""

from __future__ import annotations

import asyncio

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows.activity_io import PreparedJob, SubmitInput, TeardownInput
    from workflows.contracts import JobError, JobPolicy, JobState, Teardown
    from workflows.failures import job_error
    from workflows.job_book import JobBook
    from workflows.shared import ErrorType

PATCH_INTERRUPT_ON_STOP = "interrupt-on-stop"


async def submit(
    book: JobBook, policy: JobPolicy, prepared: PreparedJob, graph: dict[str, object]
) -> None:
    """The submit activity, for the prompt `book.new_submission` has just recorded."""
    checkpoint = book.status.checkpoint
    assert checkpoint is not None and book.prompt_id is not None
    book.set_state(JobState.SUBMITTING)
    await calls.submit(
        SubmitInput(
            job_id=book.status.job_id,
            pool=prepared.pool,
            prompt_id=book.prompt_id,
            client_id=checkpoint.client_id or "",
            segment=checkpoint.segment,
            graph=graph,
        ),
        policy,
    )
    book.mark_progress()


class TeardownStop:
    """A stop is one teardown call; an early one at the moment of the stop, when patched."""

    def __init__(self, book: JobBook) -> None:
        self._book = book
        self._early: asyncio.Task[Teardown] | None = None

    def begin(self, pool: str | None, prompt_id: str | None, order_state: JobState, _: str) -> None:
        if pool is not None and prompt_id is not None and workflow.patched(PATCH_INTERRUPT_ON_STOP):
            # Stop the GPU now: the follow activity hears of its cancel only on its next
            # heartbeat. The full teardown still runs once the work has settled.
            self._early = asyncio.create_task(self._teardown(pool, prompt_id, order_state, False))

    async def settle(
        self, pool: str, prompt_id: str, state: JobState, error: JobError | None
    ) -> None:
        if self._early is not None:
            await self._early
        free = error is not None and error.type == ErrorType.OUT_OF_MEMORY
        self._book.set_teardown(await self._teardown(pool, prompt_id, state, free))

    async def _teardown(
        self, pool: str, prompt_id: str, state: JobState, free_memory: bool
    ) -> Teardown:
        try:
            result = await calls.teardown(
                TeardownInput(
                    job_id=self._book.status.job_id,
                    pool=pool,
                    prompt_id=prompt_id,
                    reason=state.value.lower(),
                    free_memory=free_memory,
                )
            )
        except Exception as err:
            return Teardown(state="FAILED", at=workflow.now(), detail=job_error(err).message)
        return result.teardown
