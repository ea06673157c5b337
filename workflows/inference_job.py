"""The `InferenceJob` workflow: one ComfyUI job, from request to confirmed artifacts.

The story (`run`, first): check the job on its pool (a prepare, or its first follow), wait out
its tenant's budget (budget_hold.py) and for a slot of a bounded pool (pool_slot.py), run each
segment (segment_run.py), continue as new when the history grows long. Every ending stops the
prompt until confirmed, keeps what finished (stopping.py) and tells its batch and its budget's
ledger. The book writes the status (job_book.py); the handlers at the end take any message.
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import shared
    from workflows.activity_io import PreparedJob, PrepareInput
    from workflows.batches import tell_batch
    from workflows.budget_hold import prepare_and_take_slot
    from workflows.budgets import tell_ledger
    from workflows.contracts import (
        CancelRequest,
        EventsQuery,
        JobError,
        JobEvents,
        JobState,
        JobStatus,
        ResumeRequest,
        known_state,
    )
    from workflows.errors import GraphFormatError
    from workflows.failures import refused_before_submission, work_error
    from workflows.job_book import JobBook, StopOrder, new_status
    from workflows.job_input import JobCarry, JobInput, Refusal, history_is_long, read_job_input
    from workflows.messages import lenient_message, refuse_resume
    from workflows.pool_slot import PoolSlot
    from workflows.segment_run import SegmentRun
    from workflows.stopping import ConfirmedStop, start_guards
    from workflows.webhooks import BEFORE_EVERYTHING, WebhookSender


# A ValueError that escapes workflow code otherwise fails the workflow *task*, which Temporal
# retries forever: a graph the workflow cannot use (GraphFormatError) fails the workflow.
@workflow.defn(
    name=shared.WORKFLOW_TYPE, failure_exception_types=[ValidationError, GraphFormatError]
)
class InferenceJob:
    @workflow.run
    async def run(self, raw_input: RawValue) -> JobStatus:
        """The job to its end state; every way out stops the prompt and keeps the outputs."""
        if self._reading.refusal is not None:
            await self._refuse(self._reading.refusal)  # typed, before any activity
        self._book.set_state(known_state(self._status.state) if self._carry else JobState.QUEUED)
        if self._webhooks is not None:
            self._webhooks.start()
        self._work: asyncio.Task[JobCarry | None] | None = asyncio.create_task(self._run_job())
        if self._controls.stop is not None:
            self._work.cancel()  # cancelled while still queued: nothing to run
        guards_running = start_guards(self._request.policy, self._book, self._stop, self._slot)
        outcome, carry = await self._outcome_of_work()
        for guard in guards_running:
            guard.cancel()
        if carry is not None:
            carry.webhook_cursor = await self._webhooks.hand_over() if self._webhooks else None
            self._continuing = True
            await workflow.wait_condition(workflow.all_handlers_finished)
            self._book.send_search_attributes()
            workflow.continue_as_new(JobInput(request=self._request, carry=carry))
        await self._finish_uncancellable(outcome)
        await self._slot.given_back()
        await tell_batch(self._request.labels, self._status)
        await tell_ledger(self._book.budget, self._status)
        # Ended (every client sees it); its last events may still be on their way to the webhook.
        if self._webhooks is not None:
            await self._webhooks.deliver_the_rest()
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._end_result()

    @workflow.init
    def __init__(self, raw_input: RawValue) -> None:
        # Raw: a typed argument that does not decode or validate would fail the workflow task
        # (or, for ValidationError, fail it untyped); read here, a bad input is refused typed.
        self._reading = read_job_input(raw_input)
        request, carry = self._reading.input.request, self._reading.input.carry
        self._request, self._carry = request, carry
        self._prepared: PreparedJob | None = carry.prepared if carry else None
        # The request's check, for the follows until one names the pool (it stages nothing).
        self._unchecked: PrepareInput | None = None
        self._status = carry.status if carry else new_status(request)
        journal, kept = (carry.journal, carry.book) if carry else (None, None)
        self._book = JobBook(self._status, journal, kept, requested_pool=request.pool)
        self._controls = self._book.controls
        self._cancel_reason: str | None = None  # for a Temporal cancel (`cancel_reason` signal)
        self._work = None
        self._stopper = ConfirmedStop(self._book, request.policy, request.output)
        self._webhooks: WebhookSender | None = None
        if request.webhook is not None:
            # Built with the book: it counts the journal's subscribed entries from the first.
            tenant = request.labels.get(shared.TENANT_LABEL) or shared.DEFAULT_TENANT
            cursor = (carry.webhook_cursor if carry else None) or BEFORE_EVERYTHING
            self._webhooks = WebhookSender(self._book, request.webhook, tenant, cursor)
        # About to continue as new: the `ended` update answers now, and is asked again.
        self._continuing = False
        self._slot: PoolSlot = PoolSlot(request, self._book, carry.slot if carry else None)

    # -- the work ---------------------------------------------------------------------------

    async def _run_job(self) -> JobCarry | None:
        """Prepare, then run the segments; a carry when the history asks to continue as new."""
        request, book = self._request, self._book
        if self._prepared is None:
            check = PrepareInput.of(request, self._status.job_id, self._status.created_at)
            if request.inputs:
                self._prepared = await prepare_and_take_slot(book, check, self._slot)
            else:
                # Nothing to stage, nothing to prepare but the check, which the first follow
                # does before it submits (activities/backend.py): one activity to the GPU.
                self._unchecked = check
                self._prepared = PreparedJob.unchecked(request)
        first = self._carry.next_segment if self._carry else 0
        for segment in range(first, request.segment_count):
            if segment > first and history_is_long(self._request.policy.history_budget_events):
                return JobCarry(
                    status=self._status,
                    prepared=self._prepared,
                    next_segment=segment,
                    journal=self._book.journal,
                    slot=self._slot.carry(),
                    book=self._book.carry(),
                )
            run = SegmentRun(book, request, self._prepared, segment, self._slot)
            await run.run(check=self._unchecked)
        return None

    async def _outcome_of_work(self) -> tuple[BaseException | None, JobCarry | None]:
        """How the work ended (None: it completed), and its carry if it continues as new."""
        assert self._work is not None
        try:
            return None, await asyncio.shield(self._work)
        except asyncio.CancelledError:
            if self._controls.stop is None:
                # Temporal's cancel (UI button, handle.cancel()) takes the cancel signal's path.
                self._cancel(self._cancel_reason or "cancelled via Temporal", via_temporal=True)
            try:
                await self._work
            except BaseException as err:
                return err, None
            return None, None
        except BaseException as err:
            return err, None

    # -- stops: one path for every cancel, guard and failure ---------------------------------

    def _cancel(self, reason: str, *, via_temporal: bool = False) -> None:
        """Every cancel: the `cancel` signal, and Temporal's own (with the `cancel_reason`
        signal's reason, when one came first)."""
        error = JobError(type=shared.ErrorType.CANCELLED, message=reason)
        self._stop(StopOrder(JobState.CANCELLED, error, via_temporal=via_temporal))

    def _stop(self, order: StopOrder) -> None:
        """The first order holds: the work is cancelled and its prompt stopped at once."""
        if self._controls.stop is not None or self._status.terminal:
            return
        self._controls.stop = order
        if self._work is None or self._work.done():
            return
        self._work.cancel()
        self._stopper.begin(order, self._book.pool, self._book.prompt_id)

    # -- the end: refusal, teardown, compensation ---------------------------------------------

    async def _refuse(self, refusal: Refusal) -> NoReturn:
        """Fail the job, typed, before anything ran: nothing was prepared or submitted."""
        self._book.decided(StopOrder(JobState.FAILED, refusal.error))
        self._book.nothing_to_stop()
        self._book.set_state(JobState.FAILED)
        await tell_batch(self._request.labels, self._status)
        await workflow.wait_condition(workflow.all_handlers_finished)
        self._book.send_search_attributes()
        error, details = refusal.error, {"problems": refusal.problems}
        raise ApplicationError(
            error.message, self._status, details, type=error.type, non_retryable=True
        )

    async def _finish_uncancellable(self, outcome: BaseException | None) -> None:
        finishing = asyncio.create_task(self._finish(outcome))
        while not finishing.done():
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                continue  # a Temporal cancel during compensation must not cut it short

    async def _finish(self, outcome: BaseException | None) -> None:
        """Every exit path: stop the prompt, keep what finished, record it, then the end state."""
        ending = self._ending(outcome)
        book, prompt_id = self._book, self._book.prompt_id
        book.decided(ending)
        nothing_sent = self._prepared is None or self._slot.waiting or book.budget_hold is not None
        if nothing_sent or prompt_id is None or refused_before_submission(outcome):
            book.nothing_to_stop()
        else:
            await self._stopper.settle(ending, book.pool, prompt_id)
            if ending.state != JobState.COMPLETED:
                await self._stopper.keep_finished(book.pool)  # as the settled pass named it
        self._slot.give_back(ending.state)  # the prompt has provably ended, or is held
        book.set_state(ending.state)

    def _ending(self, outcome: BaseException | None) -> StopOrder:
        """The order the job stopped by, else how its work ended."""
        if self._controls.stop is not None:
            return self._controls.stop
        if outcome is None:
            return StopOrder(JobState.COMPLETED)
        return StopOrder(JobState.FAILED, work_error(outcome))

    def _end_result(self) -> JobStatus:
        self._book.send_search_attributes()
        error = self._status.error
        if self._status.state == JobState.FAILED and error is not None:
            # The Temporal UI shows the job as failed, with the typed reason.
            raise ApplicationError(error.message, self._status, type=error.type, non_retryable=True)
        order = self._controls.stop
        if self._status.state == JobState.CANCELLED and order is not None and order.via_temporal:
            raise asyncio.CancelledError(error.message if error else "")
        return self._status

    # -- messages: each takes `Any` (messages.py); changes go through the book or `_cancel`

    @workflow.query(name=shared.QUERY_STATUS)
    def status(self, _ignored: Any = None) -> JobStatus:
        return self._status

    @workflow.query(name=shared.QUERY_EVENTS)
    def events(self, payload: Any = None) -> JobEvents:
        return self._book.events_after(EventsQuery.model_validate(payload or {}).since)

    @workflow.signal(name=shared.SIGNAL_PROGRESS)
    def progress(self, payload: Any = None) -> None:
        self._book.report(payload)

    @workflow.signal(name=shared.SIGNAL_ADMISSION)
    def admission(self, payload: Any = None) -> None:
        """Its pool's queue: a place in line, or the grant (workflows/pool_queue.py)."""
        self._slot.heard(payload)

    @workflow.signal(name=shared.SIGNAL_CLIENT_SEEN)
    def client_seen(self, _ignored: Any = None) -> None:
        self._book.contact()

    @workflow.update(name=shared.UPDATE_ATTACH)
    def attach(self, payload: Any = None) -> JobStatus:
        self._book.contact()
        return self._status

    @attach.validator
    def _validate_attach(self, payload: Any = None) -> None:
        if payload not in (None, {}):
            raise ValueError("attach takes no argument (or {})")

    @workflow.update(name=shared.UPDATE_ENDED)
    async def ended(self, _ignored: Any = None) -> JobStatus:
        """The status once it is terminal: what `JobClient.wait` needs while the workflow
        still delivers its webhooks. A run about to continue as new answers with its last
        status (not terminal): the caller asks the next run."""
        await workflow.wait_condition(lambda: self._status.terminal or self._continuing)
        return self._status

    @workflow.signal(name=shared.SIGNAL_CANCEL)
    def cancel(self, payload: Any = None) -> None:
        request = self._book.read(CancelRequest, payload, "cancel", scalar_field="reason")
        self._cancel(request.reason)

    @workflow.signal(name=shared.SIGNAL_CANCEL_REASON)
    def cancel_reason(self, payload: Any = None) -> None:
        """The reason for a Temporal cancel that follows (JobClient.cancel sends both)."""
        request = self._book.read(CancelRequest, payload, "cancel_reason", scalar_field="reason")
        self._cancel_reason = request.reason

    @workflow.signal(name=shared.SIGNAL_RESUME)
    def resume(self, payload: Any = None) -> None:
        self._book.answer(*lenient_message(ResumeRequest, payload, scalar_field="resubmit"))

    @workflow.update(name=shared.UPDATE_RESUME)
    async def resume_update(self, payload: Any = None) -> JobStatus:
        """Continue a NEEDS_DECISION job; answers once the job has left that state."""
        self._book.contact()
        self._controls.resume = ResumeRequest.model_validate(payload or {})
        await workflow.wait_condition(lambda: self._status.state != JobState.NEEDS_DECISION)
        return self._status

    @resume_update.validator
    def _validate_resume(self, payload: Any = None) -> None:
        refuse_resume(self._status, payload)
