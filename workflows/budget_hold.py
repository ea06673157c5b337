"""A job held by its tenant's daily budget (workflows/budgets.py): `PENDING` with
`admission.held` = `budget` until the reset, on a durable timer, then checked again.

The check that holds a job (a prepare, or the first follow: activities/backend.py) has asked
nothing of the pool's queue and submitted nothing, so a job stopped while held has nothing to
stop. The time held is time in line: its execution deadline does not count it.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows.activity_io import PreparedJob, PrepareInput
    from workflows.budgets import BudgetHold
    from workflows.contracts import JobState
    from workflows.job_book import JobBook
    from workflows.pool_slot import PoolSlot


async def wait_for_reset(book: JobBook, slot: PoolSlot | None, hold: BudgetHold) -> None:
    """PENDING, held, until the budget day resets (and a jitter, so the jobs held at one reset
    do not all ask the ledger at once); the caller then checks the job again."""
    book.held_by_budget(hold)
    if slot is not None and slot.on_wait is not None:
        slot.on_wait()  # the execution deadline does not count the wait
    delay = hold.recheck_in_s(workflow.now(), workflow.random().random())
    await workflow.sleep(timedelta(seconds=delay), summary=f"budget of {hold.tenant} resets")
    if slot is not None and slot.on_granted_after_wait is not None:
        slot.on_granted_after_wait()
    book.budget_reset()


async def prepare_within_budget(book: JobBook, check: PrepareInput, slot: PoolSlot) -> PreparedJob:
    """The prepare of a request with input files to stage, again after each reset its tenant's
    budget held it until (staging again is idempotent: the same files at the same keys)."""
    while True:
        book.set_state(JobState.PREPARING)
        prepared = await calls.prepare(check)
        book.budgeted(prepared.budget)
        if prepared.held is None:
            return prepared
        await wait_for_reset(book, slot, prepared.held)


async def prepare_and_take_slot(book: JobBook, check: PrepareInput, slot: PoolSlot) -> PreparedJob:
    """The prepare of a request with input files, then the wait for its pool's slot; for a job
    of a group whose pool turns unable to take work while it waits, again, leaving that pool
    (the check picks the group's next pool that takes work, else the same one)."""
    while True:
        prepared = await prepare_within_budget(book, check, slot)
        book.prepared_on(prepared.pool, prepared.kind)
        if await slot.take_checked(prepared) is None:
            return prepared
        left = slot.start_left_s()
        check = check.model_copy(update={"leaving": prepared.pool, "start_by_s": left})
