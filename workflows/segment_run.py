"""One segment of a job: submit the prompt, follow it to its end, store its outputs.

When the path to the backend breaks, the segment re-attaches from the furthest checkpoint after
a durable, jittered backoff, bounded by the reconnect horizon; when the backend provably lost
the prompt, it submits it again (or asks a person first, per `on_ambiguous_submit`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import activity_calls as calls
    from workflows import shared
    from workflows.activity_io import FollowInput, FollowResult, PreparedJob, PrepareInput
    from workflows.budget_hold import wait_for_reset
    from workflows.contracts import Checkpoint, Decision, JobRequest, JobState
    from workflows.failures import (
        FailureKind,
        classify,
        failure_cost,
        job_error,
        recovered_progress,
        resubmit_cannot_run_twice,
    )
    from workflows.graph import apply_overrides, run_tag, with_unique_save_prefixes
    from workflows.job_book import JobBook, counter
    from workflows.pool_slot import PoolSlot
    from workflows.shared import AT_MOST_ONCE_RESUBMITS, ErrorType


class SegmentRun:
    def __init__(
        self,
        book: JobBook,
        request: JobRequest,
        prepared: PreparedJob,
        segment: int,
        slot: PoolSlot | None = None,
    ) -> None:
        self._slot = slot
        self._book = book
        self._controls = book.controls
        self._request = request
        self._prepared = prepared
        self._segment = segment
        self._graph: dict[str, Any] = {}
        self._tag = ""
        self._check: PrepareInput | None = None

    async def run(self, *, check: PrepareInput | None = None) -> None:
        """`check`: the request's check, for the follow to do before it submits (a request
        that stages nothing has no prepare activity of its own)."""
        self._check = check
        book, segment = self._book, self._segment
        prompt_id = str(workflow.uuid4())
        self._tag = run_tag(book.status.job_id, segment, prompt_id)
        overrides = self._request.segments[segment] if self._request.segments else {}
        graph = apply_overrides(self._prepared.graph, overrides)
        self._graph = with_unique_save_prefixes(graph, self._tag)
        sampler_steps = sum(self._prepared.sampler_steps.values())
        book.begin_segment(
            segment, self._request.segment_count, sampler_steps, self._prepared.nodes_total
        )
        checkpoint = book.new_submission(segment, prompt_id, book.status.progress.total_steps)
        # The follow submits (unless the backend has the prompt), follows it to its end and
        # stores every output: a result means the segment's outputs are in the bucket.
        result = await self._follow(checkpoint)
        book.prepared_on(result.pool, result.kind)  # unless a progress report said so
        book.followed(result)
        if not book.artifacts_of(segment):
            raise ApplicationError(
                f"segment {segment} finished without any saved output (add a SaveImage node?)",
                type=ErrorType.OUTPUT_MISSING,
                non_retryable=True,
            )
        book.end_segment()

    async def _follow(self, checkpoint: Checkpoint) -> FollowResult:
        """Follow the prompt to its end, re-attaching from the checkpoint when the path breaks."""
        book, policy = self._book, self._request.policy
        attempt = 0
        given = False  # whether an attempt was given the prompt (and so may have posted it)
        while True:
            submit = checkpoint.submitted_at is None
            first_post, given = submit and not given, True
            book.set_state(JobState.SUBMITTING if submit else book.backend_state)
            try:
                follow_input = self._follow_input(checkpoint, submit, first_post)
                result = await calls.follow(follow_input, policy)
                book.budgeted(result.budget)
                if result.outcome == "held" and result.held is not None:
                    # Its tenant's budget is spent for today: nothing was submitted. Checked
                    # again (graph, budget, slot) once the day has reset.
                    await wait_for_reset(book, self._slot, result.held)
                    given = False
                    continue
                if result.outcome != "needs_slot":
                    if self._slot is not None:
                        self._slot.followed(result)
                    return result
            except BaseException as err:
                kind = classify(err)
                cost = failure_cost(err)
                if cost is not None:
                    book.add_cost(cost)  # paid for, whatever happens next
                if kind in (FailureKind.FATAL, FailureKind.CANCELLED):
                    raise
                if self._controls.stop is not None:
                    # The stop's cancel met an attempt that had just failed by itself (say, its
                    # start-to-close timeout) and was used up on it: stop all the same.
                    raise
                recovered, artifacts = recovered_progress(err)
                book.merge_artifacts(artifacts)
                checkpoint = self._furthest(checkpoint, recovered)
                if kind == FailureKind.LOST:
                    safe = resubmit_cannot_run_twice(err)
                    checkpoint = await self._resubmit_lost(checkpoint, cannot_run_twice=safe)
                    attempt = 0
                    continue
                if kind == FailureKind.AMBIGUOUS:
                    checkpoint = await self._after_ambiguous_submission(checkpoint, err)
                    attempt = 0
                    continue
                # Not yet on the backend (a pool that is down, unhealthy or busy): still
                # submitting; otherwise the path to a running prompt broke.
                not_on_backend = checkpoint.submitted_at is None
                waiting = JobState.SUBMITTING if not_on_backend else JobState.RECONNECTING
                await self._back_off(err, attempt, waiting)
                attempt += 1
                continue
            # Checked on a bounded pool, nothing submitted: wait for a slot, then submit.
            book.prepared_on(result.pool, result.kind)
            assert self._slot is not None and result.bound is not None
            if await self._slot.take_checked(result) is not None:
                # Its pool took no work while it waited (a job of a group): checked again,
                # leaving that pool for the group's next one that does.
                assert self._check is not None
                left = self._slot.start_left_s()
                self._check = self._check.model_copy(
                    update={"leaving": result.pool, "start_by_s": left}
                )
                book.left_pool()
            given = False

    def _follow_input(self, checkpoint: Checkpoint, submit: bool, first_post: bool) -> FollowInput:
        request, prepared, book = self._request, self._prepared, self._book
        # Until the workflow hears which pool took the job, each attempt checks it first.
        check = self._check if book.status.backend is None else None
        held = self._slot is not None and self._slot.held
        return FollowInput(
            job_id=book.status.job_id,
            pool=book.pool,
            prompt_id=checkpoint.prompt_id or "",
            client_id=checkpoint.client_id or "",
            segment=self._segment,
            segments=request.segment_count,
            run_tag=self._tag,
            sampler_steps=prepared.sampler_steps,
            nodes_total=prepared.nodes_total,
            output=request.output,
            progress_interval_s=request.policy.progress_interval_s,
            checkpoint=checkpoint,
            stored=self._book.artifacts_of(self._segment),
            graph=self._graph if submit else None,
            first_post=first_post,
            execution_timeout_s=request.policy.execution_timeout_s,
            queue_timeout_s=request.policy.queue_timeout_s,
            staged_inputs=prepared.staged_inputs,
            teardown_horizon_s=request.policy.teardown_horizon_s,
            prepare=check,
            slot_held=held,
            # A check told a place waits in line itself a while: no signal, no second follow.
            slot_wait_s=shared.FOLLOW_WAITS_IN_LINE_S if check is not None and not held else 0.0,
            server=book.server,
        )

    def _furthest(self, current: Checkpoint, recovered: Checkpoint | None) -> Checkpoint:
        """Resume from the furthest point known for this prompt.

        The failed attempt's own report may be missing (a Temporal server that crashed loses
        in-memory heartbeats), but progress signals kept the status's checkpoint up to date.
        """
        candidates = [
            c
            for c in (recovered, self._book.status.checkpoint, current)
            if c is not None and c.prompt_id == current.prompt_id
        ]
        best = max(candidates, key=lambda c: (c.step, len(c.uploaded)))
        submitted_at = next((c.submitted_at for c in candidates if c.submitted_at), None)
        if best.submitted_at is None and submitted_at is not None:
            best = best.model_copy(update={"submitted_at": submitted_at})
        if best.step > current.step or len(best.uploaded) > len(current.uploaded):
            self._book.mark_progress()
        self._book.set_checkpoint(best)
        return best

    async def _back_off(self, err: BaseException, attempt: int, waiting: JobState) -> None:
        reconnect = self._request.policy.reconnect
        idle = (workflow.now() - self._book.last_progress_at).total_seconds()
        if idle > reconnect.horizon_s:
            raise ApplicationError(
                f"no progress for {idle:.0f} s (reconnect horizon {reconnect.horizon_s:.0f} s) "
                f"after {attempt} reconnect attempt(s); last error: {job_error(err).message}",
                type=ErrorType.CONNECTION_LOST,
                non_retryable=True,
            )
        delay = shared.reconnect_delay(
            attempt, reconnect.base_delay_s, reconnect.max_delay_s, workflow.random().random()
        )
        counter("reconnects", "Durable reconnect timers").add(1)
        self._book.reconnecting(job_error(err), waiting)
        await workflow.sleep(timedelta(seconds=delay), summary=f"reconnect {attempt + 1}")
        self._book.set_error(None)

    async def _resubmit_lost(self, checkpoint: Checkpoint, *, cannot_run_twice: bool) -> Checkpoint:
        """The backend provably lost the prompt: submit it once more, or ask a person first.

        A backend that cannot run it twice (RunPod with claims: its worker died) gets it again
        without asking, up to AT_MOST_ONCE_RESUBMITS times in the job; then, as any other,
        `on_ambiguous_submit` decides."""
        controls = self._controls
        unasked = cannot_run_twice and controls.unasked_resubmits < AT_MOST_ONCE_RESUBMITS
        if unasked:
            controls.unasked_resubmits += 1
        lost_before = controls.resubmits > 0 and not unasked
        policy = self._request.policy.on_ambiguous_submit
        if lost_before and policy == "fail":
            raise ApplicationError(
                "ComfyUI lost the prompt twice", type=ErrorType.PROMPT_LOST, non_retryable=True
            )
        if lost_before and policy == "pause":
            controls.resume = None
            self._book.ask(self._lost_prompt_decision(checkpoint))
            await workflow.wait_condition(lambda: controls.resume is not None)
            assert controls.resume is not None
            if not controls.resume.resubmit:
                return checkpoint
        return self._submit_again(checkpoint)

    async def _after_ambiguous_submission(
        self, checkpoint: Checkpoint, err: BaseException
    ) -> Checkpoint:
        """The submission's answer was lost and the backend cannot say whether it took it (a
        RunPod pool without claims): `on_ambiguous_submit` decides whether to risk paying twice."""
        what = job_error(err).message
        policy = self._request.policy.on_ambiguous_submit
        if policy == "fail":
            raise ApplicationError(
                f"{what} (on_ambiguous_submit is 'fail')",
                type=ErrorType.SUBMISSION_AMBIGUOUS,
                non_retryable=True,
            )
        if policy == "pause":
            await self._ask_for_resubmit(self._ambiguous_decision(checkpoint, what))
        return self._submit_again(checkpoint)

    def _submit_again(self, checkpoint: Checkpoint) -> Checkpoint:
        """The same prompt, submitted once more from its first step."""
        self._controls.resubmits += 1
        counter("resubmissions", "Prompts submitted again after the backend lost them").add(1)
        self._book.restart_prompt()
        prompt_id = checkpoint.prompt_id or str(workflow.uuid4())
        return self._book.new_submission(self._segment, prompt_id, checkpoint.total_steps)

    async def _ask_for_resubmit(self, decision: Decision) -> None:
        """NEEDS_DECISION until a resume with resubmit (a cancel ends the job meanwhile)."""
        controls = self._controls
        controls.resume = None
        self._book.ask(decision)
        while True:
            await workflow.wait_condition(lambda: controls.resume is not None)
            assert controls.resume is not None
            if controls.resume.resubmit:
                return
            self._book.notice("resume: nothing to re-attach to; resume with resubmit=true")
            controls.resume = None

    def _ambiguous_decision(self, checkpoint: Checkpoint, what: str) -> Decision:
        return Decision(
            reason=(
                f"the backend may or may not have prompt {checkpoint.prompt_id}: {what}; this "
                "pool cannot tell (no claims), and submitting again may run it twice"
            ),
            options={
                "resume --resubmit": (
                    "submit it again: if the first submission did arrive, it runs and is paid "
                    "for twice; outputs already stored are kept"
                ),
                "cancel": (
                    "end the job as CANCELLED; a first submission that did arrive is not "
                    "stopped (its job ID on the backend is unknown)"
                ),
            },
            reattach_possible=False,
            since=workflow.now(),
        )

    def _lost_prompt_decision(self, checkpoint: Checkpoint) -> Decision:
        progress = self._book.status.progress
        total = checkpoint.total_steps or progress.total_steps
        return Decision(
            reason=(
                f"the backend lost prompt {checkpoint.prompt_id} again after "
                f"{self._controls.resubmits + 1} submission(s): it is neither queued, running "
                "nor in its history (a ComfyUI restart forgets both)"
            ),
            options={
                "resume --resubmit": (
                    f"submit it once more: it runs again from the start ({total} "
                    f"{progress.unit}), paid for again; outputs already stored are kept"
                ),
                "cancel": "end the job as CANCELLED; outputs already stored are kept",
            },
            reattach_possible=False,
            since=workflow.now(),
        )
