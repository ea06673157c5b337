"""The `InferenceJob` workflow: one ComfyUI job, from request to confirmed artifacts.

The story: prepare the graph on its pool (staging its input files; a request without any is
checked by its first follow instead), then run each segment (workflows/segment_run.py: submit,
follow with durable re-attaching, store the outputs), continuing as new when the history
grows long. Cancel (signal or Temporal's own), abandonment, a queue wait, the execution deadline
(workflows/guards.py) and every failure end the same way: stop the prompt on the backend until
that is confirmed (workflows/stopping.py), keep what finished, record the end state. The job's
state lives in its status, written only by its book (workflows/job_book.py); clients read it
with the `status` query and talk to the job through the handlers in workflows/job_handlers.py.
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows.activity_io import OffloadInput, PreparedJob, PrepareInput
    from workflows.contracts import (
        JobError,
        JobState,
        JobStatus,
        Progress,
        Teardown,
        WebhookStatus,
        known_state,
    )
    from workflows.failures import job_error, refused_before_submission
    from workflows.graph import GraphFormatError, run_tag, sampler_steps
    from workflows.job_book import JobBook, StopOrder, counter
    from workflows.job_handlers import JobMessages
    from workflows.job_input import JobCarry, JobInput, Refusal, read_job_input
    from workflows.segment_run import SegmentRun
    from workflows.shared import DEFAULT_TENANT, TENANT_LABEL, WORKFLOW_TYPE, ErrorType
    from workflows.stopping import (
        ConfirmedStop,
        abandon_watchdog,
        execution_deadline,
        queue_watchdog,
    )
    from workflows.webhooks import BEFORE_EVERYTHING, WebhookSender, shown_url


# A ValueError that escapes workflow code otherwise fails the workflow *task*, which Temporal
# retries forever: a graph the workflow cannot use (GraphFormatError) fails the workflow.
@workflow.defn(name=WORKFLOW_TYPE, failure_exception_types=[ValidationError, GraphFormatError])
class InferenceJob(JobMessages):
    @workflow.init
    def __init__(self, raw_input: RawValue) -> None:
        # Raw: a typed argument that does not decode or validate would fail the workflow task
        # (or, for ValidationError, fail it untyped); read here, a bad input is refused typed.
        self._reading = read_job_input(raw_input)
        input = self._reading.input
        self._request = input.request
        self._carry = input.carry
        self._prepared: PreparedJob | None = input.carry.prepared if input.carry else None
        # The request's check, for the follows until one names the pool (a request that stages
        # nothing).
        self._unchecked: PrepareInput | None = None
        self._status = input.carry.status if input.carry else self._new_status()
        self._book = JobBook(self._status, input.carry.journal if input.carry else None)
        self._controls = self._book.controls
        # The reason a Temporal cancel that follows should carry (the `cancel_reason` signal).
        self._cancel_reason: str | None = None
        self._work: asyncio.Task[JobCarry | None] | None = None
        self._stopper = ConfirmedStop(self._book, self._request.policy, self._request.output)
        self._webhooks: WebhookSender | None = None
        if self._request.webhook is not None:
            # Built with the book: it counts the journal's subscribed entries from the first.
            cursor = input.carry.webhook_cursor if input.carry else None
            tenant = self._request.labels.get(TENANT_LABEL) or DEFAULT_TENANT
            self._webhooks = WebhookSender(
                self._book, self._request.webhook, tenant, cursor or BEFORE_EVERYTHING
            )
        # About to continue as new: the `ended` update answers now, and is asked again.
        self._continuing = False

    @workflow.run
    async def run(self, raw_input: RawValue) -> JobStatus:
        """The job to its end state; every way out stops the prompt and keeps the outputs."""
        if self._reading.refusal is not None:
            await self._refuse(self._reading.refusal)  # typed, before any activity
        self._book.set_state(known_state(self._status.state) if self._carry else JobState.QUEUED)
        if self._webhooks is not None:
            self._webhooks.start()
        self._work = asyncio.create_task(self._run_job())
        if self._controls.stop is not None:
            self._work.cancel()  # cancelled while still queued: nothing to run
        guards_running = self._start_guards()
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
        # The job has ended (and says so to every client); its last events may still be on
        # their way to the webhook.
        if self._webhooks is not None:
            await self._webhooks.deliver_the_rest()
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._end_result()

    def _new_status(self) -> JobStatus:
        now, policy = workflow.now(), self._request.policy
        return JobStatus(
            job_id=workflow.info().workflow_id,
            progress=Progress(segments=self._request.segment_count),
            detached=policy.detached,
            abandon_after_s=policy.abandon_after_s,
            created_at=now,
            updated_at=now,
            last_client_contact_at=now,
            webhook=WebhookStatus(
                url=shown_url(self._request.webhook.url), events=self._request.webhook.events
            )
            if self._request.webhook is not None
            else None,
        )

    # -- the work ---------------------------------------------------------------------------

    async def _run_job(self) -> JobCarry | None:
        """Prepare, then run the segments; a carry when the history asks to continue as new."""
        request, book = self._request, self._book
        if self._carry is None or self._prepared is None:
            self._prepare_or_defer()
        if self._prepared is None:
            book.set_state(JobState.PREPARING)
            self._prepared = await calls.prepare(self._prepare_input())
            book.prepared_on(self._prepared.pool, self._prepared.kind)
        first = self._carry.next_segment if self._carry else 0
        for segment in range(first, request.segment_count):
            if segment > first and self._history_is_long():
                return JobCarry(
                    status=self._status,
                    prepared=self._prepared,
                    next_segment=segment,
                    journal=self._book.journal,
                )
            run = SegmentRun(book, request, self._prepared, segment)
            await run.run(check=self._unchecked)
        return None

    def _prepare_or_defer(self) -> None:
        """A request that stages no input file has nothing to prepare but its check, which its
        first follow does before submitting (activities/backend.py): the job's way to its GPU
        is one activity, not two. Its prepared graph is its own."""
        request = self._request
        if request.inputs:
            return
        self._unchecked = self._prepare_input()
        self._prepared = PreparedJob(
            pool=request.pool or "",  # "": the worker's default pool, named by the check
            kind="",
            graph=request.graph,
            sampler_steps=sampler_steps(request.graph),
            nodes_total=len(request.graph),
        )

    def _prepare_input(self) -> PrepareInput:
        request = self._request
        return PrepareInput(
            job_id=self._status.job_id,
            pool=request.pool,
            graph=request.graph,
            inputs=request.inputs,
            segments=request.segments,
            output=request.output,
            webhook=request.webhook,
            # The label as the request has it: a job without one is not a tenant's
            # (activities/inputs.py confines a tenant's s3:// inputs to its own area).
            tenant=request.labels.get(TENANT_LABEL),
        )

    def _start_guards(self) -> list[asyncio.Task[None]]:
        policy, stop = self._request.policy, self._stop
        running = [asyncio.create_task(execution_deadline(policy, stop))]
        if policy.abandon_after_s is not None:
            watchdog = abandon_watchdog(policy.abandon_after_s, self._book, stop)
            running.append(asyncio.create_task(watchdog))
        if policy.queue_timeout_s is not None:
            queue = queue_watchdog(policy.queue_timeout_s, self._book, stop)
            running.append(asyncio.create_task(queue))
        return running

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

    def _history_is_long(self) -> bool:
        info = workflow.info()
        budget = self._request.policy.history_budget_events
        return (
            info.is_continue_as_new_suggested() or info.get_current_history_length() > budget // 2
        )

    # -- the end: refusal, stop, compensation -------------------------------------------------

    async def _refuse(self, refusal: Refusal) -> NoReturn:
        """Fail the job, typed, before anything ran: nothing was prepared or submitted."""
        counter("jobs_ended", "Jobs by end state").add(1, {"state": JobState.FAILED.value})
        book = self._book
        book.set_error(refusal.error)
        book.set_teardown(
            Teardown(state="SKIPPED", at=workflow.now(), detail="nothing was submitted")
        )
        book.set_state(JobState.FAILED)
        await workflow.wait_condition(workflow.all_handlers_finished)
        book.send_search_attributes()
        raise ApplicationError(
            refusal.error.message,
            self._status,
            {"problems": refusal.problems},
            type=refusal.error.type,
            non_retryable=True,
        )

    def _cancel(self, reason: str, *, via_temporal: bool = False) -> None:
        """Every cancel: the `cancel` signal, and Temporal's own (with the `cancel_reason`
        signal's reason, when one came first)."""
        error = JobError(type=ErrorType.CANCELLED, message=reason)
        self._stop(StopOrder(JobState.CANCELLED, error, via_temporal=via_temporal))

    def _stop(self, order: StopOrder) -> None:
        """The one stop path (a cancel, a guard's timer): the first order holds; the work is
        cancelled and its prompt stopped at once."""
        if self._controls.stop is not None or self._status.terminal:
            return
        self._controls.stop = order
        if self._work is None or self._work.done():
            return
        self._work.cancel()
        self._stopper.begin(order, self._pool(), self._book.prompt_id)

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
        counter("jobs_ended", "Jobs by end state").add(1, {"state": ending.state.value})
        book, prompt_id = self._book, self._book.prompt_id
        book.set_error(ending.error)
        if self._prepared is None or prompt_id is None or refused_before_submission(outcome):
            skipped = Teardown(state="SKIPPED", at=workflow.now(), detail="nothing was submitted")
            book.set_teardown(skipped)
        else:
            await self._stopper.settle(ending, self._pool() or "", prompt_id)
            if ending.state != JobState.COMPLETED:
                await self._keep_finished_outputs(self._pool() or "")
        book.set_state(ending.state)

    def _pool(self) -> str | None:
        return self._book.pool_or(self._prepared.pool) if self._prepared is not None else None

    def _ending(self, outcome: BaseException | None) -> StopOrder:
        """The order the job stopped by, else how its work ended."""
        if self._controls.stop is not None:
            return self._controls.stop
        if outcome is None:
            return StopOrder(JobState.COMPLETED)
        if isinstance(outcome, GraphFormatError):
            # A segment's overrides that do not fit the graph (a request prepare did not see).
            error = JobError(type=ErrorType.INVALID_REQUEST, message=str(outcome))
            return StopOrder(JobState.FAILED, error)
        return StopOrder(JobState.FAILED, job_error(outcome))

    async def _keep_finished_outputs(self, pool: str) -> None:
        checkpoint = self._status.checkpoint
        if checkpoint is None or checkpoint.prompt_id is None:
            return
        try:
            kept = await calls.offload(
                OffloadInput(
                    job_id=self._status.job_id,
                    pool=pool,
                    prompt_id=checkpoint.prompt_id,
                    segment=checkpoint.segment,
                    run_tag=run_tag(self._status.job_id, checkpoint.segment, checkpoint.prompt_id),
                    output=self._request.output,
                    stored=self._book.artifacts_of(checkpoint.segment),
                    partial=True,
                )
            )
        except Exception as err:
            # The cause, not the ActivityError's "Activity task failed": what to look at.
            workflow.logger.warning("keeping finished outputs failed: %s", job_error(err).message)
            return
        self._book.merge_artifacts(kept.artifacts)

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
