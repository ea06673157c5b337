"""The `InferenceJob` workflow: one ComfyUI job, from request to confirmed artifacts.

The story: prepare the graph on its pool, then run each segment (workflows/segment_run.py:
submit, follow with durable re-attaching, store the outputs), continuing as new when the history
grows long. Cancel (signal or Temporal's own), abandonment, a queue wait, the execution deadline
(workflows/guards.py) and every failure end the same way: stop the prompt on the backend until
that is confirmed (workflows/stopping.py), keep what finished, record the end state. The job's
state lives in its status (workflows/job_book.py); clients read it with the `status` query.
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from pydantic import ValidationError
from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows import guards
    from workflows.activity_io import OffloadInput, PreparedJob, PrepareInput
    from workflows.contracts import (
        CancelRequest,
        JobError,
        JobState,
        JobStatus,
        Progress,
        ProgressReport,
        ResumeRequest,
        Teardown,
    )
    from workflows.failures import job_error
    from workflows.graph import GraphFormatError, run_tag
    from workflows.input_refusal import Refusal, read_job_input
    from workflows.job_book import JobBook
    from workflows.job_controls import JobControls, StopOrder
    from workflows.job_input import JobCarry, JobInput
    from workflows.job_metrics import counter
    from workflows.legacy import TeardownStop
    from workflows.messages import M, lenient_message, strict_message
    from workflows.segment_run import SegmentRun
    from workflows.shared import (
        QUERY_STATUS,
        SIGNAL_CANCEL,
        SIGNAL_CANCEL_REASON,
        SIGNAL_CLIENT_SEEN,
        SIGNAL_PROGRESS,
        SIGNAL_RESUME,
        UPDATE_ATTACH,
        UPDATE_RESUME,
        WORKFLOW_TYPE,
        ErrorType,
    )
    from workflows.stopping import ConfirmedStop

# Patches: each guards a change in what the workflow does, so running jobs keep replaying.
PATCH_SHIELDED_FINISH = "shielded-finish"
# v3: the follow activity submits (socket first), and a stop is confirmed on durable timers
# until the prompt is gone. Asked once at the start of a run; older runs take workflows/legacy.py.
PATCH_CONFIRMED_STOP = "submit-in-follow-confirmed-stop"
# v8: an input the workflow cannot use fails the job typed (workflows/input_refusal.py), also
# one that the checks of earlier versions let through. Asked only when the input is refused.
PATCH_REFUSE_INPUT = "refuse-input-typed"


# A ValueError that escapes workflow code otherwise fails the workflow *task*, which Temporal
# retries forever: a graph the workflow cannot use (GraphFormatError) fails the workflow.
@workflow.defn(name=WORKFLOW_TYPE, failure_exception_types=[ValidationError, GraphFormatError])
class InferenceJob:
    @workflow.init
    def __init__(self, raw_input: RawValue) -> None:
        # Raw: a typed argument that does not decode or validate would fail the workflow task
        # (or, for ValidationError, fail it untyped); read here, a bad input is refused typed.
        self._reading = read_job_input(raw_input)
        input = self._reading.input
        self._request = input.request
        self._carry = input.carry
        if input.carry is not None:
            status = input.carry.status
            self._prepared: PreparedJob | None = input.carry.prepared
        else:
            now = workflow.now()
            policy = input.request.policy
            status = JobStatus(
                job_id=workflow.info().workflow_id,
                progress=Progress(segments=input.request.segment_count),
                detached=policy.detached,
                abandon_after_s=policy.abandon_after_s,
                created_at=now,
                updated_at=now,
                last_client_contact_at=now,
            )
            self._prepared = None
        self._status = status
        self._book = JobBook(status)
        self._controls = JobControls()
        self._work: asyncio.Task[JobCarry | None] | None = None
        # Decided at the start of the run (None until then): which submit and stop paths.
        self._legacy: bool | None = None
        self._stopper: ConfirmedStop | TeardownStop | None = None
        self._cancelled_via_temporal = False

    # -- messages ---------------------------------------------------------------------------

    # Every handler takes `Any` and reads it in workflows/messages.py: a plain client may send
    # nothing, `{}` or a misspelt field, and a signature that cannot take it would fail every
    # workflow task from then on.

    @workflow.query(name=QUERY_STATUS)
    def status(self, _ignored: Any = None) -> JobStatus:
        return self._status

    @workflow.signal(name=SIGNAL_PROGRESS)
    def progress(self, payload: Any = None) -> None:
        try:
            report = ProgressReport.model_validate(payload)
        except ValidationError as exc:
            self._book.notice(f"progress: ignored a malformed report ({exc.error_count()} errors)")
            return
        if report.attempt_client_id != self._book.client_id or self._status.terminal:
            return  # from a socket of an earlier submission, or too late
        stage_changes = self._legacy is False and self._controls.stop is None
        self._book.apply_progress(report, stage_changes=stage_changes)

    @workflow.signal(name=SIGNAL_CLIENT_SEEN)
    def client_seen(self, _ignored: Any = None) -> None:
        self._book.contact()

    @workflow.update(name=UPDATE_ATTACH)
    def attach(self, payload: Any = None) -> JobStatus:
        self._book.contact()
        return self._status

    @attach.validator
    def _validate_attach(self, payload: Any = None) -> None:
        if payload not in (None, {}):
            raise ValueError("attach takes no argument (or {})")

    @workflow.signal(name=SIGNAL_CANCEL)
    def cancel(self, payload: Any = None) -> None:
        request = self._read(CancelRequest, payload, "cancel", scalar_field="reason")
        self._request_stop(JobState.CANCELLED, ErrorType.CANCELLED, request.reason)

    @workflow.signal(name=SIGNAL_CANCEL_REASON)
    def cancel_reason(self, payload: Any = None) -> None:
        """The reason for a Temporal cancel that follows (JobClient.cancel sends both)."""
        request = self._read(CancelRequest, payload, "cancel_reason", scalar_field="reason")
        self._controls.cancel_reason = request.reason

    @workflow.signal(name=SIGNAL_RESUME)
    def resume(self, payload: Any = None) -> None:
        message, notes = lenient_message(ResumeRequest, payload, scalar_field="resubmit")
        self._book.contact()
        if notes:
            # A decision is not guessed from a garbled message (was `resubmt` meant?).
            self._book.notice(f"resume: ignored, nothing done: {'; '.join(notes)}")
            return
        if self._status.state != JobState.NEEDS_DECISION:
            self._book.notice(f"resume: ignored, the job is {self._status.state.value}")
            return
        self._controls.resume = message

    @workflow.update(name=UPDATE_RESUME)
    async def resume_update(self, payload: Any = None) -> JobStatus:
        """Continue a NEEDS_DECISION job; answers once the job has left that state."""
        self._book.contact()
        self._controls.resume = ResumeRequest.model_validate(payload or {})
        await workflow.wait_condition(lambda: self._status.state != JobState.NEEDS_DECISION)
        return self._status

    @resume_update.validator
    def _validate_resume(self, payload: Any = None) -> None:
        request = strict_message(ResumeRequest, payload, what="resume")
        state = self._status.state
        if state != JobState.NEEDS_DECISION:
            raise ValueError(
                f"the job is {state.value}: resume only continues a job that waits for a "
                "decision (NEEDS_DECISION)"
            )
        decision = self._status.decision
        if not request.resubmit and decision is not None and not decision.reattach_possible:
            raise ValueError(
                f"cannot re-attach: {decision.reason}. Resume with resubmit=true "
                f"({decision.options.get('resume --resubmit', 'run the prompt again')}), or "
                "cancel the job"
            )

    def _read(
        self, model: type[M], payload: Any, what: str, *, scalar_field: str | None = None
    ) -> M:
        message, notes = lenient_message(model, payload, scalar_field=scalar_field)
        for note in notes:
            self._book.notice(f"{what}: {note}")
        return message

    # -- the job ----------------------------------------------------------------------------

    @workflow.run
    async def run(self, raw_input: RawValue) -> JobStatus:
        """The job to its end state; every way out stops the prompt and keeps the outputs."""
        refusal = self._reading.refusal
        if refusal is not None:
            if workflow.patched(PATCH_REFUSE_INPUT):
                await self._refuse(refusal)
            if refusal.legacy_failure is not None:
                raise refusal.legacy_failure  # how earlier versions failed on this input
            # Earlier versions ran this request (its checks came later): so does its replay.
        self._legacy = not workflow.patched(PATCH_CONFIRMED_STOP)
        self._stopper = (
            TeardownStop(self._book)
            if self._legacy
            else ConfirmedStop(self._book, self._request.policy, self._request.output)
        )
        self._book.set_state(self._status.state if self._carry else JobState.QUEUED)
        self._work = asyncio.create_task(self._run_job())
        if self._controls.stop is not None:
            self._work.cancel()  # cancelled while still queued: nothing to run
        guards_running = self._start_guards()
        outcome, carry = await self._outcome_of_work()
        for guard in guards_running:
            guard.cancel()
        if carry is not None:
            await workflow.wait_condition(workflow.all_handlers_finished)
            workflow.continue_as_new(JobInput(request=self._request, carry=carry))
        await self._finish_uncancellable(outcome)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._end_result()

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
        raise ApplicationError(
            refusal.error.message,
            self._status,
            {"problems": refusal.problems},
            type=refusal.error.type,
            non_retryable=True,
        )

    async def _run_job(self) -> JobCarry | None:
        """Prepare, then run the segments; a carry when the history asks to continue as new."""
        request, book = self._request, self._book
        if self._carry is None or self._prepared is None:
            book.set_state(JobState.PREPARING)
            self._prepared = await calls.prepare(
                PrepareInput(
                    job_id=self._status.job_id,
                    pool=request.pool,
                    graph=request.graph,
                    inputs=request.inputs,
                    segments=request.segments,
                    output=request.output,
                )
            )
            book.prepared_on(self._prepared.pool, self._prepared.kind)
        first = self._carry.next_segment if self._carry else 0
        for segment in range(first, request.segment_count):
            if segment > first and self._history_is_long():
                return JobCarry(status=self._status, prepared=self._prepared, next_segment=segment)
            assert self._legacy is not None
            await SegmentRun(
                book, self._controls, request, self._prepared, segment, legacy_submit=self._legacy
            ).run()
        return None

    def _start_guards(self) -> list[asyncio.Task[None]]:
        policy, stop = self._request.policy, self._request_stop
        running = [asyncio.create_task(guards.execution_deadline(policy, stop))]
        if policy.abandon_after_s is not None:
            watchdog = guards.abandon_watchdog(policy.abandon_after_s, self._book, stop)
            running.append(asyncio.create_task(watchdog))
        if not self._legacy and policy.queue_timeout_s is not None:
            queue = guards.queue_watchdog(policy.queue_timeout_s, self._book, stop)
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
                self._cancelled_via_temporal = True
                reason = self._controls.cancel_reason or "cancelled via Temporal"
                self._request_stop(JobState.CANCELLED, ErrorType.CANCELLED, reason)
            try:
                await self._work
            except BaseException as err:
                return err, None
            return None, None
        except BaseException as err:
            return err, None

    # -- stopping and compensation ----------------------------------------------------------

    def _request_stop(self, state: JobState, error_type: str, message: str) -> None:
        if self._controls.stop is not None or self._status.terminal:
            return
        self._controls.stop = StopOrder(state, JobError(type=error_type, message=message))
        if self._work is None or self._work.done():
            return
        self._work.cancel()
        assert self._stopper is not None
        pool = self._prepared.pool if self._prepared else None
        self._stopper.begin(pool, self._book.prompt_id, state, error_type)

    async def _finish_uncancellable(self, outcome: BaseException | None) -> None:
        if not workflow.patched(PATCH_SHIELDED_FINISH):
            await self._finish(outcome)  # runs from before the shield
            return
        finishing = asyncio.create_task(self._finish(outcome))
        while not finishing.done():
            try:
                await asyncio.shield(finishing)
            except asyncio.CancelledError:
                continue  # a Temporal cancel during compensation must not cut it short

    async def _finish(self, outcome: BaseException | None) -> None:
        """Every exit path: stop the prompt, keep what finished, record it, then the end state."""
        order = self._controls.stop
        if order is not None:
            state, error = order.state, order.error
        elif outcome is None:
            state, error = JobState.COMPLETED, None
        elif isinstance(outcome, GraphFormatError):
            # A segment's overrides that do not fit the graph (a request prepare did not see).
            error = JobError(type=ErrorType.INVALID_REQUEST, message=str(outcome))
            state = JobState.FAILED
        else:
            state, error = JobState.FAILED, job_error(outcome)
        counter("jobs_ended", "Jobs by end state").add(1, {"state": state.value})
        book, prompt_id = self._book, self._book.prompt_id
        book.set_error(error)
        if self._prepared is None or prompt_id is None:
            skipped = Teardown(state="SKIPPED", at=workflow.now(), detail="nothing was submitted")
            book.set_teardown(skipped)
        else:
            assert self._stopper is not None
            await self._stopper.settle(self._prepared.pool, prompt_id, state, error)
            if state != JobState.COMPLETED:
                await self._keep_finished_outputs(self._prepared.pool)
        book.set_state(state)

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
        error = self._status.error
        if self._status.state == JobState.FAILED and error is not None:
            # The Temporal UI shows the job as failed, with the typed reason.
            raise ApplicationError(error.message, self._status, type=error.type, non_retryable=True)
        if self._status.state == JobState.CANCELLED and self._cancelled_via_temporal:
            raise asyncio.CancelledError(error.message if error else "")
        return self._status

    def _history_is_long(self) -> bool:
        info = workflow.info()
        budget = self._request.policy.history_budget_events
        return (
            info.is_continue_as_new_suggested() or info.get_current_history_length() > budget // 2
        )
