"""A job's side of its bounded pool's queue (workflows/pool_queue.py): ask, wait, give back.

A job on a pool with `max_running` asks the pool's dispatcher for a slot once it is checked,
and is `PENDING` until granted; nothing of it reaches the pool before. It gives the slot back
only when its prompt has provably ended: completed, or a teardown CONFIRMED or SKIPPED. A
teardown UNCONFIRMED or FAILED keeps the slot, marked unsettled, until the provider's own
execution timeout has surely ended the prompt or an operator settles it (`pool release`). A job
that leaves before its grant (cancelled, failed, expired) gives its place in line back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import shared
    from workflows.activity_io import FollowResult, PreparedJob
    from workflows.admission import Admission, PoolBound, SlotRelease, SlotRequest, SlotUnsettled
    from workflows.contracts import JobRequest, JobState
    from workflows.job_book import JobBook

# How long the job's wait for a dispatcher that has not answered at all lasts before it asks
# again (a dispatcher that was terminated and started afresh does not know it). Once it has
# answered, the job waits for the grant without a timer.
ASK_AGAIN_AFTER_S = 300.0


class SlotCarry(BaseModel):
    """A job's slot across its continue-as-new: the new run holds it as the old one did."""

    bound: PoolBound
    granted: bool = True
    group: str | None = None


class PoolSlot:
    def __init__(self, request: JobRequest, book: JobBook, carry: SlotCarry | None) -> None:
        self._book = book
        self._request = request
        self._status = book.status
        self.bound: PoolBound | None = carry.bound if carry else None
        self.granted = carry.granted if carry else False
        self._given_back = False
        self._answered = False
        # How the job's state moves when the queue answers; what happens when the job starts to
        # wait in line, and when that wait ends with the grant (set by the guards).
        self.on_answer: Callable[[Admission], None] = book.admission
        self._giving_back: asyncio.Task[None] | None = None
        self._early: Admission | None = None
        self.on_wait: Any = None
        self.on_granted_after_wait: Any = None
        self._waited = False
        # In line by a follow that waits for the grant itself (its reports say where it is).
        self._in_follow = False
        # A job of a group (its request names one): the group, and the pool's latest word that
        # it takes no work (`_unwell`). When a pool it waits in turns so, `relocate` says why:
        # its wait ends, and the job's check picks the group's next pool that takes work.
        self.group: str | None = carry.group if carry else None
        self._unwell: str | None = None
        self._late_told = False
        self.relocate: str | None = None
        # Why the job's wait ended last (what its move records).
        self._leaving_because: str | None = None
        self._leaving: list[asyncio.Task[bool]] = []
        book.on_slot_held = self.held_by_check
        book.on_pool_named = self.pool_named
        book.on_slot_waiting = self.waits_in_follow

    @property
    def waiting(self) -> bool:
        """In line for a bounded pool's slot, not granted: nothing of the job has been sent."""
        return self.bound is not None and not self.granted

    @property
    def held(self) -> bool:
        return self.granted and not self._given_back

    def carry(self) -> SlotCarry | None:
        if self.bound is None:
            return None
        return SlotCarry(bound=self.bound, granted=self.granted, group=self.group)

    @property
    def tenant(self) -> str:
        return self._request.labels.get(shared.TENANT_LABEL) or shared.DEFAULT_TENANT

    async def take(
        self, bound: PoolBound | None, *, asked: bool = False, answer: Admission | None = None
    ) -> str | None:
        """Ask the pool's queue (unless the check has: `asked`, with the queue's `answer` when
        it gave one) and wait for the grant (PENDING meanwhile, when the queue says so);
        nothing to wait for on an unbounded pool (None). Cancelled with the job: the place in
        line is given back by `give_back`. A job of a group whose pool turns unable to take
        work stops waiting: why (its place is kept until its next check picks another pool)."""
        if self.granted or bound is None:
            return None
        await self._moving_to(bound)
        self.bound = bound
        self._in_follow = False  # waits by signal from here on
        self._book.awaiting_slot = True
        early, self._early = self._early, None
        # The check's answer first; then what the queue signalled before the check's result
        # came in (a grant that followed a place).
        for word in (answer, early):
            if word is not None:
                self.heard(word)
        if asked and not self._answered:
            # Asked by the check, the answer to come by signal: in line meanwhile.
            self._in_line(bound)
        while not self.granted and self.relocate is None:
            if not asked:
                await self._ask(bound)
                asked = True
            if self._answered:
                # In line: the grant comes by signal, however long the line.
                await workflow.wait_condition(lambda: self.granted or self.relocate is not None)
                break
            try:
                await workflow.wait_condition(
                    lambda: self.granted or self._answered or self.relocate is not None,
                    timeout=timedelta(seconds=ASK_AGAIN_AFTER_S),
                    timeout_summary="pool queue answer",
                )
            except TimeoutError:
                asked = False  # no word from the queue at all: ask again (a repeat is harmless)
        self._book.awaiting_slot = False
        if self.granted:
            return None
        reason, self.relocate = self.relocate, None
        self._leaving_because = reason
        return reason

    async def take_checked(self, checked: PreparedJob | FollowResult) -> str | None:
        """`take`, after a check that found the pool bounded (and may have asked already)."""
        if checked.group is not None:
            self.group = checked.group
        return await self.take(checked.bound, asked=checked.slot_asked, answer=checked.admission)

    async def _moving_to(self, bound: PoolBound) -> None:
        self.pool_named(bound.pool)
        await self.moves_told()

    def pool_named(self, pool: str | None) -> None:
        """The job heard which pool its check picked: a job of a group checked again that
        picked another pool than the one it waits in gives its place there back (by signal,
        awaited by `moves_told`) and records the move, whether the new pool is bounded or
        not."""
        old = self.bound
        if self.group is None or old is None or pool is None or old.pool == pool:
            return
        if self.granted or self._given_back:
            return
        release = self._release("withdrawn")
        self._leaving.append(
            asyncio.create_task(self._signal(shared.SIGNAL_SLOT_RELEASE, release, pool=old.pool))
        )
        self._book.moved(old.pool, pool, self._leaving_because or "its pool took no work")
        self._answered, self._unwell, self.relocate = False, None, None
        self._late_told, self._leaving_because = False, None
        # In no line until the new pool's check result says whether it has one.
        self.bound = None

    async def moves_told(self) -> None:
        """Until the places left by moves are given back (their signals delivered)."""
        while self._leaving:
            await self._leaving.pop()

    def heard(self, payload: Any) -> None:
        """The queue's word: a place in line, or the grant (anything else is ignored: a
        signal never fails the job)."""
        try:
            answer = Admission.model_validate(payload)
        except ValueError:
            return
        if self.bound is None and not self._given_back:
            # Asked by the check, answered before the workflow heard the check's result.
            self._early = answer
            return
        if self._given_back or self.bound is None:
            return
        if answer.pool != self.bound.pool:
            if self.group is not None:
                # A job of a group checked again on another pool: that queue's word came
                # before the check's result (`take` hears it then).
                self._early = answer
            return
        self._answered = True
        if self.granted:
            return
        if answer.granted:
            self.granted = True
        elif self.group is not None:
            # Told its pool takes no work (newly: not again while it stays so), or that it would
            # not start there before its start deadline (once a pool): the wait ends.
            if answer.unhealthy is not None and self._unwell is None:
                self.relocate = answer.unhealthy
            self._unwell = answer.unhealthy
            late = self._late(answer)
            if self.relocate is None and late is not None and not self._late_told:
                self._late_told = True
                self.relocate = late
        if self.on_answer is not None:
            self.on_answer(answer)
        if not answer.granted and not self._waited:
            self._waited = True
            if self.on_wait is not None:
                self.on_wait()
        elif answer.granted and self._waited and self.on_granted_after_wait is not None:
            self.on_granted_after_wait()

    def start_left_s(self) -> float | None:
        """How long the job has left to begin running by its `start_by_s` (None: no deadline)."""
        start_by = self._request.policy.start_by_s
        if start_by is None:
            return None
        accepted = self._status.created_at or workflow.now()
        return max(start_by - (workflow.now() - accepted).total_seconds(), 0.0)

    def _late(self, answer: Admission) -> str | None:
        """Why the job would not start in its pool in time, by the queue's estimate; None."""
        left = self.start_left_s()
        if left is None or answer.eta_s is None or answer.eta_s <= left:
            return None
        return (
            f"estimated start in {answer.eta_s:.0f} s, {left:.0f} s left of its "
            f"start_by_s ({self._request.policy.start_by_s:.0f} s)"
        )

    def _in_line(self, bound: PoolBound) -> None:
        """PENDING, place not known yet (not an answer: the job still asks again if none
        comes)."""
        unplaced = Admission(
            pool=bound.pool,
            job_id=self._status.job_id,
            priority=self._request.priority,
            tenant=self.tenant,
        )
        if self.on_answer is not None:
            self.on_answer(unplaced)
        if not self._waited:
            self._waited = True
            if self.on_wait is not None:
                self.on_wait()

    def waits_in_follow(self, bound: PoolBound, answer: Admission) -> None:
        """A follow's check was told a place and waits for the grant itself: PENDING there (its
        next report with the slot, or its result, says it was granted)."""
        if self.granted or self._given_back:
            return
        self.bound, self._in_follow = bound, True
        if answer.position is None:
            self._in_line(bound)
        else:
            self.heard(answer)

    def held_by_check(self, bound: PoolBound, answer: Admission | None = None) -> None:
        """A follow's own check was granted the slot and went on to submit (an idle pool: no
        second follow); its report or its result says so, or a stop check finds the pool
        bounded when the job had heard of no slot (it may hold one: giving back one it does
        not hold changes nothing). The job holds the slot from then, and gives it back (or
        holds it unsettled) at its end as after any grant."""
        if self._given_back or self.granted:
            return
        if self.bound is not None and self.bound.pool != bound.pool:
            # A job of a group that left its pool's line: its check picked another pool and
            # was granted a slot of it at once.
            self.pool_named(bound.pool)
        elif self.bound is not None and not self._in_follow:
            return  # in line by signal: the grant comes by signal
        if self._in_follow and self._book.pending:
            # Its follow was granted in line and submits: the job follows its prompt again
            # (the report's stage then says where the prompt is).
            self._book.set_state(JobState.SUBMITTING)
        self.bound = bound
        if answer is None or not answer.granted:
            # A report carries the slot, not the queue's answer: the same grant, as the job
            # has it.
            answer = Admission(
                pool=bound.pool,
                job_id=self._status.job_id,
                granted=True,
                priority=self._request.priority,
                tenant=self.tenant,
                as_of=workflow.now(),
            )
        self.heard(answer)

    def followed(self, result: FollowResult) -> None:
        """A follow's result: the slot its check was granted, and whether it gave it back."""
        if result.bound is not None:
            self.held_by_check(result.bound, result.admission)
        if result.slot_released:
            self.given_back_by_follow()

    def given_back_by_follow(self) -> None:
        """The follow that saw the job's last prompt end gave the slot back (its signal)."""
        if self.bound is not None:
            self._given_back = True

    def give_back(self, ending: JobState) -> None:
        """At the job's end (once its prompt has provably ended, or is known not to have):
        the slot, the place in line, or an unsettled hold goes back, while the end state is
        written (`given_back`)."""
        if self.bound is not None and not self._given_back:
            self._giving_back = asyncio.create_task(self._give_back(ending))

    async def given_back(self) -> None:
        """Until the giving back is delivered: a signal initiated by a workflow that closes in
        the same task is not delivered (tried: the queue never heard it)."""
        await self.moves_told()
        if self._giving_back is not None:
            await self._giving_back

    async def _give_back(self, ending: JobState) -> None:
        if self.bound is None or self._given_back:
            return
        self._given_back = True
        teardown = self._status.teardown.state
        provably_ended = teardown in ("CONFIRMED", "SKIPPED")
        if not self.granted and (provably_ended or not self._in_follow):
            await self._signal(shared.SIGNAL_SLOT_RELEASE, self._release("withdrawn"))
        elif not self.granted:
            # Its follow may have been granted the slot and submitted before the job heard:
            # held until settled, as any unconfirmed stop (a place in line is simply let go).
            await self._signal(shared.SIGNAL_SLOT_UNSETTLED, self._unsettled())
        elif ending == JobState.COMPLETED or provably_ended:
            await self._signal(shared.SIGNAL_SLOT_RELEASE, self._release("ended"))
        else:
            await self._signal(shared.SIGNAL_SLOT_UNSETTLED, self._unsettled())

    # -- inside -------------------------------------------------------------------------------

    def _release(self, reason: Literal["ended", "withdrawn"]) -> SlotRelease:
        return SlotRelease(job_id=self._status.job_id, reason=reason)

    def _unsettled(self) -> SlotUnsettled:
        assert self.bound is not None
        settle_at = None
        if self.bound.settle_after_s is not None:
            checkpoint = self._status.checkpoint
            since = (checkpoint.submit_sent_at or checkpoint.submitted_at) if checkpoint else None
            since = since or workflow.now()
            settle_at = since + timedelta(seconds=self.bound.settle_after_s)
        teardown = self._status.teardown
        return SlotUnsettled(
            job_id=self._status.job_id,
            settle_at=settle_at,
            detail=f"teardown {teardown.state}: {teardown.detail}"[:300],
        )

    async def _ask(self, bound: PoolBound) -> None:
        ask = SlotRequest.of_bound(
            bound,
            job_id=self._status.job_id,
            tenant=self.tenant,
            priority=self._request.priority,
            accepted_at=self._status.created_at or workflow.now(),
        )
        if await self._signal(shared.SIGNAL_SLOT_REQUEST, ask):
            return
        # No dispatcher runs for the pool yet: an activity starts it with the request.
        await workflow.execute_activity(
            shared.ACTIVITY_OPEN_POOL_QUEUE,
            args=[bound.pool, ask],
            start_to_close_timeout=timedelta(seconds=30),
            summary=f"open the queue of pool {bound.pool}",
        )

    async def _signal(self, name: str, message: BaseModel, *, pool: str | None = None) -> bool:
        assert self.bound is not None or pool is not None
        queue = shared.pool_queue_id(
            workflow.info().task_queue, pool or (self.bound.pool if self.bound else "")
        )
        try:
            await workflow.get_external_workflow_handle(queue).signal(name, message)
        except Exception:
            return False
        return True
