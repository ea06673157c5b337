"""The `InferenceJob` workflow: one ComfyUI job, from request to confirmed artifacts.

prepare → for each segment: submit → follow (re-attaching with durable, jittered backoff when
the path breaks) → offload → COMPLETED. Cancel (signal or Temporal's own), abandonment (no client
contact within `abandon_after_s`), the execution deadline and every failure stop the work and run
the same compensation: stop the prompt on the backend, keep what finished, record the teardown.
The job's state lives here; clients read it with the `status` query.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.common import MetricCounter
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows.activity_io import (
        FollowInput,
        FollowResult,
        OffloadInput,
        PreparedJob,
        PrepareInput,
        SubmitInput,
        TeardownInput,
    )
    from workflows.backoff import reconnect_delay
    from workflows.contracts import (
        BackendInfo,
        CancelRequest,
        Checkpoint,
        Decision,
        JobError,
        JobRequest,
        JobState,
        JobStatus,
        Progress,
        ProgressReport,
        ResumeRequest,
        Teardown,
    )
    from workflows.failures import FailureKind, classify, job_error, recovered_progress
    from workflows.graph import apply_overrides, with_unique_save_prefixes
    from workflows.job_book import POOL_KEY, JobBook
    from workflows.messages import M, lenient_message, strict_message
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
    from workflows.stopping import PromptStop, stop_reason


# Patches: each guards a change in what the workflow does, so running jobs keep replaying.
PATCH_INTERRUPT_ON_STOP = "interrupt-on-stop"
PATCH_SHIELDED_FINISH = "shielded-finish"
# v3: the follow activity submits (socket first), and a stop is confirmed on durable timers
# until the prompt is gone. Asked once at the start of a run; older runs keep the v2 paths.
PATCH_CONFIRMED_STOP = "submit-in-follow-confirmed-stop"


class JobCarry(BaseModel):
    """What a job carries across continue-as-new: where it is and what it has."""

    status: JobStatus
    prepared: PreparedJob
    next_segment: int


class _Stop(BaseModel):
    state: JobState
    error: JobError | None = None


class _ContinueAsNew(Exception):
    def __init__(self, carry: JobCarry) -> None:
        super().__init__("continue as new")
        self.carry = carry


@workflow.defn(name=WORKFLOW_TYPE, failure_exception_types=[ValidationError])
class InferenceJob:
    @workflow.init
    def __init__(self, request: JobRequest, carry: JobCarry | None = None) -> None:
        # The SDK applies type hints only when the argument count matches them all: a fresh
        # start sends one argument, continue-as-new two. Validate here either way; a bad payload
        # raises ValidationError, which fails the workflow instead of retrying its task.
        request = JobRequest.model_validate(request)
        carry = JobCarry.model_validate(carry) if carry is not None else None
        now = workflow.now()
        self._request = request
        if carry is not None:
            self._status = carry.status
            self._prepared: PreparedJob | None = carry.prepared
        else:
            self._status = JobStatus(
                job_id=workflow.info().workflow_id,
                progress=Progress(segments=max(1, len(request.segments))),
                detached=request.policy.detached,
                abandon_after_s=request.policy.abandon_after_s,
                created_at=now,
                updated_at=now,
                last_client_contact_at=now,
            )
            self._prepared = None
        self._client_id: str | None = None  # progress from older sockets is ignored
        checkpoint = self._status.checkpoint
        self._prompt_id: str | None = checkpoint.prompt_id if checkpoint else None
        self._stop: _Stop | None = None
        self._cancelled_via_temporal = False
        self._early_teardown: asyncio.Task[Teardown] | None = None
        self._resubmits = 0
        self._work: asyncio.Task[None] | None = None
        self._contacts = 0
        self._resume: ResumeRequest | None = None
        self._book = JobBook(self._status)
        self._v3 = False
        self._stopper = PromptStop(self._book, request.policy)
        self._early_stop: asyncio.Task[None] | None = None
        self._cancel_reason: str | None = None

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
        if report.attempt_client_id != self._client_id or self._status.terminal:
            return
        self._book.apply_progress(report, stage_changes=self._v3 and self._stop is None)

    @workflow.signal(name=SIGNAL_CLIENT_SEEN)
    def client_seen(self, _ignored: Any = None) -> None:
        self._contact()

    @workflow.update(name=UPDATE_ATTACH)
    def attach(self, payload: Any = None) -> JobStatus:
        self._contact()
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
        self._cancel_reason = request.reason

    @workflow.signal(name=SIGNAL_RESUME)
    def resume(self, payload: Any = None) -> None:
        message, notes = lenient_message(ResumeRequest, payload, scalar_field="resubmit")
        self._contact()
        if notes:
            # A decision is not guessed from a garbled message (was `resubmt` meant?).
            self._book.notice(f"resume: ignored, nothing done: {'; '.join(notes)}")
            return
        if self._status.state != JobState.NEEDS_DECISION:
            self._book.notice(f"resume: ignored, the job is {self._status.state.value}")
            return
        self._resume = message

    @workflow.update(name=UPDATE_RESUME)
    async def resume_update(self, payload: Any = None) -> JobStatus:
        """Continue a NEEDS_DECISION job; answers once the job has left that state."""
        self._contact()
        self._resume = ResumeRequest.model_validate(payload or {})
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

    # -- the process ------------------------------------------------------------------------

    @workflow.run
    async def run(self, request: JobRequest, carry: JobCarry | None = None) -> JobStatus:
        request = self._request
        carry = JobCarry.model_validate(carry) if carry is not None else None
        self._v3 = workflow.patched(PATCH_CONFIRMED_STOP)
        self._book.set_state(self._status.state if carry else JobState.QUEUED)
        self._work = asyncio.create_task(self._run_job(request, carry))
        if self._stop is not None:
            self._work.cancel()  # cancelled while still queued: nothing to run
        guards = [asyncio.create_task(self._deadline(request))]
        abandon_after = request.policy.abandon_after_s
        if abandon_after is not None:
            guards.append(asyncio.create_task(self._watchdog(abandon_after)))
        queue_timeout = request.policy.queue_timeout_s
        if self._v3 and queue_timeout is not None:
            guards.append(asyncio.create_task(self._queue_watchdog(queue_timeout)))
        outcome: BaseException | None = None
        try:
            await asyncio.shield(self._work)
        except _ContinueAsNew as again:
            for guard in guards:
                guard.cancel()
            await workflow.wait_condition(workflow.all_handlers_finished)
            workflow.continue_as_new(args=[request, again.carry])
        except asyncio.CancelledError:
            if self._stop is None:
                # Temporal's cancel (UI button, handle.cancel()) takes the cancel signal's path.
                self._cancelled_via_temporal = True
                self._request_stop(
                    JobState.CANCELLED,
                    ErrorType.CANCELLED,
                    self._cancel_reason or "cancelled via Temporal",
                )
            outcome = await self._settle_work()
        except BaseException as err:
            outcome = err
        for guard in guards:
            guard.cancel()
        if workflow.patched(PATCH_SHIELDED_FINISH):
            finishing = asyncio.create_task(self._finish(request, outcome))
            while not finishing.done():
                try:
                    await asyncio.shield(finishing)
                except asyncio.CancelledError:
                    continue  # a Temporal cancel during compensation must not cut it short
        else:
            await self._finish(request, outcome)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self._end_result()

    async def _run_job(self, request: JobRequest, carry: JobCarry | None) -> None:
        if carry is None or self._prepared is None:
            self._book.set_state(JobState.PREPARING)
            self._prepared = await calls.prepare(
                PrepareInput(
                    job_id=self._status.job_id,
                    pool=request.pool,
                    graph=request.graph,
                    inputs=request.inputs,
                    segments=request.segments,
                )
            )
            self._status.backend = BackendInfo(pool=self._prepared.pool, kind=self._prepared.kind)
            workflow.upsert_search_attributes([POOL_KEY.value_set(self._prepared.pool)])
        segments = request.segments or [{}]
        first = carry.next_segment if carry else 0
        for segment in range(first, len(segments)):
            if segment > first and self._history_is_long(request):
                raise _ContinueAsNew(
                    JobCarry(status=self._status, prepared=self._prepared, next_segment=segment)
                )
            await self._run_segment(request, self._prepared, segment, segments[segment])

    async def _run_segment(
        self,
        request: JobRequest,
        prepared: PreparedJob,
        segment: int,
        overrides: dict[str, dict[str, object]],
    ) -> None:
        job_id = self._status.job_id
        prompt_id = str(workflow.uuid4())
        run_tag = f"dc_{safe_tag(job_id)}_{segment}_{prompt_id[:8]}"
        graph = with_unique_save_prefixes(apply_overrides(prepared.graph, overrides), run_tag)
        total = sum(prepared.sampler_steps.values())
        self._status.progress = Progress(
            segment=segment,
            segments=max(1, len(request.segments)),
            total_steps=total or prepared.nodes_total,
            fraction=segment / max(1, len(request.segments)),
            unit="steps" if total else "nodes",
        )
        if self._v3:
            checkpoint = self._new_submission(prepared, segment, prompt_id, total)
        else:
            checkpoint = await self._submit(prepared, segment, prompt_id, graph, total)
        followed = await self._follow(request, prepared, segment, run_tag, graph, checkpoint)
        self._book.merge_artifacts(followed.artifacts)
        self._status.checkpoint = followed.checkpoint
        self._book.set_state(JobState.UPLOADING)
        offloaded = await calls.offload(
            OffloadInput(
                job_id=job_id,
                pool=prepared.pool,
                prompt_id=prompt_id,
                segment=segment,
                run_tag=run_tag,
                output=request.output,
                stored=self._book.artifacts_of(segment),
            )
        )
        self._book.merge_artifacts(offloaded.artifacts)
        if not self._book.artifacts_of(segment):
            raise ApplicationError(
                f"segment {segment} finished without any saved output (add a SaveImage node?)",
                type=ErrorType.OUTPUT_MISSING,
                non_retryable=True,
            )
        self._status.progress.step = self._status.progress.total_steps
        self._status.progress.fraction = (segment + 1) / max(1, len(request.segments))
        self._book.mark_progress()
        self._book.touch()

    def _new_submission(
        self, prepared: PreparedJob, segment: int, prompt_id: str, total_steps: int
    ) -> Checkpoint:
        """A prompt the follow activity will submit; recorded before anything is sent, so a
        cancel mid-submit still finds it. A fresh client_id drops any late progress report
        of an earlier submission."""
        client_id = f"dc-{workflow.uuid4()}"
        self._client_id = client_id
        self._prompt_id = prompt_id
        checkpoint = Checkpoint(
            job_id=self._status.job_id,
            segment=segment,
            prompt_id=prompt_id,
            client_id=client_id,
            total_steps=total_steps or prepared.nodes_total,
            updated_at=workflow.now(),
        )
        self._status.checkpoint = checkpoint
        if self._status.backend is not None:
            self._status.backend.provider_job_id = prompt_id
        self._book.backend_state = JobState.RUNNING  # nothing is known of the new prompt yet
        self._status.progress.queue_position = None
        self._book.mark_progress()
        return checkpoint

    async def _submit(
        self,
        prepared: PreparedJob,
        segment: int,
        prompt_id: str,
        graph: dict[str, object],
        total_steps: int,
    ) -> Checkpoint:
        """Before v3: a submit activity of its own, then the follow activity."""
        checkpoint = self._new_submission(prepared, segment, prompt_id, total_steps)
        self._book.set_state(JobState.SUBMITTING)
        await calls.submit(
            SubmitInput(
                job_id=self._status.job_id,
                pool=prepared.pool,
                prompt_id=prompt_id,
                client_id=checkpoint.client_id or "",
                segment=segment,
                graph=graph,
            ),
            self._request.policy,
        )
        self._book.mark_progress()
        return checkpoint

    async def _follow(
        self,
        request: JobRequest,
        prepared: PreparedJob,
        segment: int,
        run_tag: str,
        graph: dict[str, object],
        checkpoint: Checkpoint,
    ) -> FollowResult:
        """Follow the prompt to its end, re-attaching from the checkpoint when the path breaks."""
        policy = request.policy
        attempt = 0
        while True:
            submit = self._v3 and checkpoint.submitted_at is None
            if not self._v3:
                self._book.set_state(JobState.RUNNING)
            elif submit:
                self._book.set_state(JobState.SUBMITTING)
            else:
                self._book.set_state(self._book.backend_state)
            try:
                result = await calls.follow(
                    FollowInput(
                        job_id=self._status.job_id,
                        pool=prepared.pool,
                        prompt_id=checkpoint.prompt_id or "",
                        client_id=checkpoint.client_id or "",
                        segment=segment,
                        segments=max(1, len(request.segments)),
                        run_tag=run_tag,
                        sampler_steps=prepared.sampler_steps,
                        nodes_total=prepared.nodes_total,
                        output=request.output,
                        progress_interval_s=policy.progress_interval_s,
                        checkpoint=checkpoint,
                        stored=self._book.artifacts_of(segment),
                        graph=graph if submit else None,
                    ),
                    policy,
                )
                return result
            except BaseException as err:
                kind = classify(err)
                if kind in (FailureKind.FATAL, FailureKind.CANCELLED):
                    raise
                if self._v3 and self._stop is not None:
                    # The stop's cancel met an attempt that had just failed by itself (say, its
                    # start-to-close timeout) and was used up on it: stop all the same.
                    raise
                recovered, artifacts = recovered_progress(err)
                self._book.merge_artifacts(artifacts)
                checkpoint = self._furthest(checkpoint, recovered)
                if kind == FailureKind.LOST:
                    checkpoint = await self._resubmit_lost(prepared, segment, graph, checkpoint)
                    attempt = 0
                    continue
                # Not yet on the backend (a pool that is down, unhealthy or busy): still
                # submitting; otherwise the path to a running prompt broke.
                not_on_backend = self._v3 and checkpoint.submitted_at is None
                waiting = JobState.SUBMITTING if not_on_backend else JobState.RECONNECTING
                await self._back_off(err, attempt, policy.reconnect.horizon_s, waiting)
                attempt += 1

    def _furthest(self, current: Checkpoint, recovered: Checkpoint | None) -> Checkpoint:
        """Resume from the furthest point known for this prompt.

        The failed attempt's own report may be missing (a Temporal server that crashed loses
        in-memory heartbeats), but progress signals kept the status's checkpoint up to date.
        """
        candidates = [
            c
            for c in (recovered, self._status.checkpoint, current)
            if c is not None and c.prompt_id == current.prompt_id
        ]
        best = max(candidates, key=lambda c: (c.step, len(c.uploaded)))
        submitted_at = next((c.submitted_at for c in candidates if c.submitted_at), None)
        if self._v3 and best.submitted_at is None and submitted_at is not None:
            best = best.model_copy(update={"submitted_at": submitted_at})
        if best.step > current.step or len(best.uploaded) > len(current.uploaded):
            self._book.mark_progress()
        self._status.checkpoint = best
        return best

    async def _back_off(
        self,
        err: BaseException,
        attempt: int,
        horizon_s: float,
        waiting: JobState = JobState.RECONNECTING,
    ) -> None:
        policy = self._request.policy.reconnect
        idle = (workflow.now() - self._book.last_progress_at).total_seconds()
        if idle > horizon_s:
            raise ApplicationError(
                f"no progress for {idle:.0f} s (reconnect horizon {horizon_s:.0f} s) after "
                f"{attempt} reconnect attempt(s); last error: {job_error(err).message}",
                type=ErrorType.CONNECTION_LOST,
                non_retryable=True,
            )
        delay = reconnect_delay(
            attempt, policy.base_delay_s, policy.max_delay_s, workflow.random().random()
        )
        self._status.reconnects += 1
        metric("reconnects", "Durable reconnect timers").add(1)
        self._status.error = job_error(err)
        self._book.set_state(waiting)
        await workflow.sleep(timedelta(seconds=delay), summary=f"reconnect {attempt + 1}")
        self._status.error = None

    async def _resubmit_lost(
        self, prepared: PreparedJob, segment: int, graph: dict[str, object], checkpoint: Checkpoint
    ) -> Checkpoint:
        """ComfyUI provably lost the prompt: submit it once more, or ask a person first."""
        lost_before = self._resubmits > 0
        policy = self._request.policy.on_ambiguous_submit
        if lost_before and policy == "fail":
            raise ApplicationError(
                "ComfyUI lost the prompt twice", type=ErrorType.PROMPT_LOST, non_retryable=True
            )
        if lost_before and policy == "pause":
            self._resume = None
            self._status.decision = self._lost_prompt_decision(checkpoint)
            self._book.set_state(JobState.NEEDS_DECISION)
            await workflow.wait_condition(lambda: self._resume is not None)
            assert self._resume is not None
            if not self._resume.resubmit:
                return checkpoint
        self._resubmits += 1
        metric("resubmissions", "Prompts submitted again after the backend lost them").add(1)
        self._status.progress.step = 0  # the prompt runs again from the start
        prompt_id = checkpoint.prompt_id or str(workflow.uuid4())
        if self._v3:
            return self._new_submission(prepared, segment, prompt_id, checkpoint.total_steps)
        return await self._submit(prepared, segment, prompt_id, graph, checkpoint.total_steps)

    def _lost_prompt_decision(self, checkpoint: Checkpoint) -> Decision:
        total = checkpoint.total_steps or self._status.progress.total_steps
        unit = self._status.progress.unit
        return Decision(
            reason=(
                f"the backend lost prompt {checkpoint.prompt_id} again after "
                f"{self._resubmits + 1} submission(s): it is neither queued, running nor in "
                "its history (a ComfyUI restart forgets both)"
            ),
            options={
                "resume --resubmit": (
                    f"submit it once more: it runs again from the start ({total} {unit}), "
                    "paid for again; outputs already stored are kept"
                ),
                "cancel": "end the job as CANCELLED; outputs already stored are kept",
            },
            reattach_possible=False,
            since=workflow.now(),
        )

    # -- stopping and compensation ----------------------------------------------------------

    def _request_stop(self, state: JobState, error_type: str, message: str) -> None:
        if self._stop is not None or self._status.terminal:
            return
        self._stop = _Stop(state=state, error=JobError(type=error_type, message=message))
        if self._work is None or self._work.done():
            return
        self._work.cancel()
        if self._v3:
            self._book.set_state(JobState.STOPPING)
            if self._prepared is not None and self._prompt_id is not None:
                # Stop the GPU now: the follow activity hears of its cancel only on its next
                # heartbeat. The settled pass in _finish confirms once the work has ended.
                self._early_stop = asyncio.create_task(
                    self._stopper.confirm(
                        self._prepared.pool,
                        self._prompt_id,
                        stop_reason(state, error_type == ErrorType.TIMEOUT),
                        submitted=self._submitted(),
                        settled=False,
                    )
                )
            return
        if (
            self._prepared is not None
            and self._prompt_id is not None
            and workflow.patched(PATCH_INTERRUPT_ON_STOP)
        ):
            # Stop the GPU now: the follow activity hears of its cancel only on its next
            # heartbeat (up to 0.8 x heartbeat_timeout later). The full teardown still runs and
            # confirms once the work has settled.
            self._early_teardown = asyncio.create_task(
                self._teardown(self._prepared.pool, self._prompt_id, state, False)
            )

    async def _settle_work(self) -> BaseException | None:
        assert self._work is not None
        try:
            await self._work
        except BaseException as err:
            return err
        return None

    async def _deadline(self, request: JobRequest) -> None:
        await workflow.sleep(
            timedelta(seconds=request.policy.execution_timeout_s), summary="execution deadline"
        )
        self._request_stop(
            JobState.FAILED,
            ErrorType.TIMEOUT,
            f"the job ran past execution_timeout_s ({request.policy.execution_timeout_s:.0f} s)",
        )

    async def _queue_watchdog(self, queue_timeout_s: float) -> None:
        """A prompt that waits in the backend's queue longer than `queue_timeout_s` fails the
        job (`QueueTimeout`): the GPU it waits for is not coming in time."""
        book = self._book
        while True:
            await workflow.wait_condition(lambda: book.backend_state == JobState.WAITING)
            waiting_for = self._prompt_id

            def moved_on(prompt: str | None = waiting_for) -> bool:
                return book.backend_state != JobState.WAITING or self._prompt_id != prompt

            try:
                await workflow.wait_condition(
                    moved_on,
                    timeout=timedelta(seconds=queue_timeout_s),
                    timeout_summary="queue timeout",
                )
            except TimeoutError:
                position = self._status.progress.queue_position
                self._request_stop(
                    JobState.FAILED,
                    ErrorType.QUEUE_TIMEOUT,
                    f"prompt {waiting_for} waited in the backend's queue (place {position}) "
                    f"longer than queue_timeout_s ({queue_timeout_s:.0f} s)",
                )
                return

    async def _watchdog(self, abandon_after_s: float) -> None:
        while True:
            seen = self._contacts
            try:
                await workflow.wait_condition(
                    lambda seen=seen: self._contacts != seen,  # type: ignore[misc]
                    timeout=timedelta(seconds=abandon_after_s),
                    timeout_summary="abandon watchdog",
                )
            except TimeoutError:
                self._request_stop(
                    JobState.ABANDONED,
                    ErrorType.ABANDONED,
                    f"no client contact for {abandon_after_s:.0f} s",
                )
                return

    async def _finish(self, request: JobRequest, outcome: BaseException | None) -> None:
        """Every exit path: stop the prompt, keep what finished, record it, then the end state."""
        if self._stop is not None:
            state, error = self._stop.state, self._stop.error
        elif outcome is None:
            state, error = JobState.COMPLETED, None
        else:
            state, error = JobState.FAILED, job_error(outcome)
        metric("jobs_ended", "Jobs by end state").add(1, {"state": state.value})
        self._status.error = error
        pool = self._prepared.pool if self._prepared else None
        if self._v3:
            await self._finish_v3(request, state, error, pool)
            return
        if pool is None or self._prompt_id is None:
            self._status.teardown = Teardown(
                state="SKIPPED", at=workflow.now(), detail="nothing was submitted"
            )
        else:
            if self._early_teardown is not None:
                await self._early_teardown
            free = error is not None and error.type == ErrorType.OUT_OF_MEMORY
            self._status.teardown = await self._teardown(pool, self._prompt_id, state, free)
            if state != JobState.COMPLETED:
                await self._keep_finished_outputs(request, pool)
        self._book.set_state(state)

    async def _finish_v3(
        self, request: JobRequest, state: JobState, error: JobError | None, pool: str | None
    ) -> None:
        if pool is None or self._prompt_id is None:
            self._status.teardown = Teardown(
                state="SKIPPED", at=workflow.now(), detail="nothing was submitted"
            )
            self._book.set_state(state)
            return
        if state != JobState.COMPLETED:
            self._book.set_state(JobState.STOPPING)
        if self._early_stop is not None:
            await self._early_stop
        timed_out = error is not None and error.type == ErrorType.TIMEOUT
        await self._stopper.confirm(
            pool,
            self._prompt_id,
            stop_reason(state, timed_out),
            submitted=self._submitted(),
            settled=True,
            free_memory=error is not None and error.type == ErrorType.OUT_OF_MEMORY,
        )
        if state != JobState.COMPLETED:
            await self._keep_finished_outputs(request, pool)
        self._book.set_state(state)

    def _submitted(self) -> bool:
        """Did the backend acknowledge the current prompt (as far as the workflow heard)?"""
        checkpoint = self._status.checkpoint
        return (
            checkpoint is not None
            and checkpoint.prompt_id == self._prompt_id
            and checkpoint.submitted_at is not None
        )

    async def _teardown(
        self, pool: str, prompt_id: str, state: JobState, free_memory: bool
    ) -> Teardown:
        try:
            result = await calls.teardown(
                TeardownInput(
                    job_id=self._status.job_id,
                    pool=pool,
                    prompt_id=prompt_id,
                    reason=state.value.lower(),
                    free_memory=free_memory,
                )
            )
        except Exception as err:
            return Teardown(state="FAILED", at=workflow.now(), detail=job_error(err).message)
        return result.teardown

    async def _keep_finished_outputs(self, request: JobRequest, pool: str) -> None:
        checkpoint = self._status.checkpoint
        if checkpoint is None or checkpoint.prompt_id is None:
            return
        run_tag = f"dc_{safe_tag(self._status.job_id)}_{checkpoint.segment}_"
        run_tag += checkpoint.prompt_id[:8]
        try:
            kept = await calls.offload(
                OffloadInput(
                    job_id=self._status.job_id,
                    pool=pool,
                    prompt_id=checkpoint.prompt_id,
                    segment=checkpoint.segment,
                    run_tag=run_tag,
                    output=request.output,
                    stored=self._book.artifacts_of(checkpoint.segment),
                    partial=True,
                )
            )
        except Exception as err:
            workflow.logger.warning("keeping finished outputs failed: %s", err)
            return
        self._book.merge_artifacts(kept.artifacts)

    def _end_result(self) -> JobStatus:
        if self._status.state == JobState.FAILED and self._status.error is not None:
            # The Temporal UI shows the job as failed, with the typed reason.
            raise ApplicationError(
                self._status.error.message,
                self._status,
                type=self._status.error.type,
                non_retryable=True,
            )
        if self._status.state == JobState.CANCELLED and self._cancelled_via_temporal:
            raise asyncio.CancelledError(self._status.error.message if self._status.error else "")
        return self._status

    # -- state bookkeeping ------------------------------------------------------------------

    def _contact(self) -> None:
        self._contacts += 1
        self._status.last_client_contact_at = workflow.now()
        self._book.touch()

    def _history_is_long(self, request: JobRequest) -> bool:
        info = workflow.info()
        budget = request.policy.history_budget_events
        return (
            info.is_continue_as_new_suggested() or info.get_current_history_length() > budget // 2
        )


def metric(name: str, description: str) -> MetricCounter:
    """A counter of the workflow's meter (silent while replaying), named durable_comfy_*."""
    return workflow.metric_meter().create_counter("durable_comfy_" + name, description)


def safe_tag(job_id: str) -> str:
    """The job ID as a file-name component on the backend (no ':' on every filesystem)."""
    cleaned = "".join(c if c.isalnum() or c in "-_" else "_" for c in job_id)
    return cleaned[:48]
