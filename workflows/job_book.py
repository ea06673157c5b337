"""The job's status, and the one place every change to it ends.

Nothing assigns to the status but the methods here and, for `status.webhook`, the webhook
sender's (workflows/webhooks.py). Every write ends in `changed()`: it bumps `seq` once and
`updated_at` (clients' `watch` relies on it), journals what a follower must see, and refreshes
the Temporal UI's current details (`CurrentDetails`, below: no history event, so the UI stays as
current as a `status` query). State changes (only) upsert the `JobState` and `JobProgress`
search attributes, so the UI shows the job at a glance without a history event per progress
step; all that changed in one workflow task goes out as one upsert (one history event), at its
end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError
from temporalio import workflow
from temporalio.common import MetricCounter, SearchAttributeUpdate

with workflow.unsafe.imports_passed_through():
    from workflows.activity_io import FollowResult
    from workflows.admission import Admission, PoolBound, PoolMove, place_in_line
    from workflows.budgets import BudgetHold
    from workflows.contracts import (
        MAX_JOURNAL,
        MAX_NOTICES,
        Artifact,
        BackendInfo,
        Checkpoint,
        Decision,
        Delivery,
        JobCost,
        JobError,
        JobEvent,
        JobEvents,
        JobRequest,
        JobState,
        JobStatus,
        Notice,
        Progress,
        ProgressReport,
        ResumeRequest,
        Teardown,
        TeardownStep,
        WebhookStatus,
        shown_url,
    )
    from workflows.messages import M, lenient_message
    from workflows.shared import POOL_KEY, PROGRESS_KEY, STATE_KEY, ErrorType


def counter(name: str, description: str) -> MetricCounter:
    """A counter named durable_comfy_<name>, on the SDK's workflow meter (silent while
    replaying)."""
    return workflow.metric_meter().create_counter("durable_comfy_" + name, description)


def new_status(request: JobRequest) -> JobStatus:
    """A new job's first status (a continued run carries its own)."""
    now, policy, webhook = workflow.now(), request.policy, request.webhook
    return JobStatus(
        job_id=workflow.info().workflow_id,
        progress=Progress(segments=request.segment_count),
        detached=policy.detached,
        abandon_after_s=policy.abandon_after_s,
        created_at=now,
        updated_at=now,
        last_client_contact_at=now,
        webhook=WebhookStatus(url=shown_url(webhook.url), events=webhook.events)
        if webhook is not None
        else None,
    )


def at_task_end(callback: Callable[[], None], changes: Callable[[], int]) -> None:
    """Run `callback` once the workflow code of this activation has settled: a whole turn of
    the loop (everything ready run, then every condition checked, which the workflow's event
    loop does only when nothing else is ready, and what that woke run too) in which `changes()`
    did not move."""

    async def when_settled() -> None:
        while True:
            before = changes()
            await workflow.wait_condition(lambda: True)
            await asyncio.sleep(0)  # after what the same check woke
            if changes() == before:
                break
        callback()

    asyncio.get_running_loop().create_task(when_settled())


class BookCarry(BaseModel):
    """What the book keeps across continue-as-new besides the status and its journal."""

    # The tenant whose daily budget counts the job (its check said so; None: no budget).
    budget: str | None = None
    # Each submission's (client id's) measured run on a comfyui pool: `JobStatus.gpu_s`.
    ran_s: dict[str, float] = Field(default_factory=dict)


@dataclass(frozen=True)
class StopOrder:
    """How the job ends and why: ordered while its work runs (a cancel, a guard's timer), or
    read from how the work ended. `error` becomes the status's error (None: completed)."""

    state: JobState
    error: JobError | None = None
    # Temporal's own cancel (its UI, `temporal workflow cancel`, `JobClient.cancel`): the run
    # then ends Canceled in Temporal too, not Completed.
    via_temporal: bool = False

    @property
    def timed_out(self) -> bool:
        return self.error is not None and self.error.type == ErrorType.TIMEOUT


@dataclass
class JobControls:
    """What clients asked of the running job, and what the work keeps count of across its
    segments: read by the handlers and the work, never part of the status."""

    stop: StopOrder | None = None
    # The answer to a NEEDS_DECISION; cleared when a new question is asked.
    resume: ResumeRequest | None = None
    # Prompts submitted again after the backend lost them, over the whole job.
    resubmits: int = 0
    # Of those, the ones nobody was asked about: a backend that cannot run a prompt twice lost
    # its worker (`AT_MOST_ONCE_RESUBMITS` at most).
    unasked_resubmits: int = 0


class JobBook:
    def __init__(
        self,
        status: JobStatus,
        journal: list[JobEvent] | None = None,
        kept: BookCarry | None = None,
        *,
        requested_pool: str | None = None,
    ) -> None:
        self.status = status
        kept = kept or BookCarry()
        # The tenant whose ledger the job tells its spend at its end (workflows/budgets.py),
        # and what holds it until its budget resets (None: nothing).
        self.budget: str | None = kept.budget
        self.budget_hold: BudgetHold | None = None
        # How long each submission (by client id) has run on a comfyui pool, as measured.
        self._ran: dict[str, float] = dict(kept.ran_s)
        self._requested = requested_pool
        # What a follower must not miss (state changes, stored outputs, tenths of progress),
        # numbered by the seq that wrote them: the `events` query and the webhooks read it.
        # A continued run carries it; a new job journals its first state too.
        self.journal: list[JobEvent] = journal if journal is not None else []
        self._journaled_state: str | None = status.state if journal is not None else None
        self._journaled_artifacts = len(status.artifacts)
        self._journaled_percent = self._percent()
        # When the job last moved (a step, an artifact, a submission): the reconnect horizon
        # counts from here.
        self.last_progress_at = workflow.now()
        self._last_coarse_progress = -1
        # Where the backend last said the prompt is: waiting in its queue, or running.
        self.backend_state = JobState.RUNNING
        self._details = CurrentDetails()
        # The current submission: progress reports from any other socket are stale.
        checkpoint = status.checkpoint
        self.prompt_id: str | None = checkpoint.prompt_id if checkpoint else None
        self.client_id: str | None = None
        # A prompt whose successful end the follow activity saw on the backend: nothing of it
        # runs any more, so a completed job's teardown needs no check of its own.
        self.finished_prompt: str | None = None
        # The server of a pool of many the job's grant named, heard before the job knew its
        # pool (kept until `prepared_on` makes the status's backend).
        self._server: str | None = None
        # Messages from clients: the abandon watchdog waits for this to move.
        self.contacts = 0
        self.controls = JobControls()
        # Search attributes changed in this workflow task, by name: upserted once, at its end.
        self._unsent_attributes: dict[str, SearchAttributeUpdate[Any]] = {}
        self._attribute_writes = 0
        self._journal_listeners: list[Callable[[list[JobEvent]], None]] = []
        self._began = False
        # In line for a bounded pool's slot (workflows/pool_slot.py): nothing is submitted.
        self.awaiting_slot = False
        # A follow's report said its own check was granted a slot (set by the job's PoolSlot).
        self.on_slot_held: Callable[[PoolBound], None] | None = None
        # A follow's report said it waits in line for the slot itself, at the place it names.
        self.on_slot_waiting: Callable[[PoolBound, Admission], None] | None = None
        # The job heard which pool its check picked (a job of a group may have moved).
        self.on_pool_named: Callable[[str], None] | None = None

    # -- the run --------------------------------------------------------------------------

    def set_state(self, state: JobState) -> None:
        changed = self._put_state(state)
        self.changed()
        # The search attributes follow state changes; the status's first write (seq 1) writes
        # them too, since the run starts in a state nothing has written yet, unless the client
        # that started the job already set them to it.
        if changed or (self.status.seq == 1 and not self._started_as(state)):
            self._upsert(
                STATE_KEY.value_set(state.value), PROGRESS_KEY.value_set(self.coarse_progress())
            )

    def prepared_on(self, pool: str | None, kind: str | None) -> None:
        """The job's pool, once: by its prepare, or by the follow that checked the request
        (which may have submitted the prompt already). A report that names no pool and kind
        (None) says nothing of it."""
        if pool is None or kind is None:
            return
        if self.on_pool_named is not None:
            self.on_pool_named(pool)
        backend = self.status.backend
        if backend is not None and (backend.pool, backend.kind) == (pool, kind):
            return
        self.status.backend = BackendInfo(
            pool=pool, kind=kind, provider_job_id=self.prompt_id, server=self._server
        )
        if self.status.checkpoint is not None:
            self._note_provider_job(self.status.checkpoint)
        self._upsert(POOL_KEY.value_set(pool))
        self.changed()

    def admission(self, answer: Admission) -> None:
        """Its pool's queue answered: a place in line (PENDING, unless the job is on its way
        out), or the grant (the state then moves on with the submission)."""
        moves = self.status.admission.moves if self.status.admission is not None else []
        self.status.admission = answer.model_copy(update={"job_id": None, "moves": moves})
        if answer.granted and answer.server is not None:
            self.ran_on(answer.server)
        waiting_states = (JobState.QUEUED, JobState.PREPARING, JobState.SUBMITTING)
        if answer.granted or self.controls.stop is not None:
            self.changed()
        elif self.status.state in waiting_states:
            self.set_state(JobState.PENDING)
        else:
            self.changed()

    def budgeted(self, tenant: str | None) -> None:
        """The check found the job's tenant has a daily budget: the job tells its ledger its
        spend at its end (None says nothing)."""
        if tenant is not None:
            self.budget = tenant

    def held_by_budget(self, hold: BudgetHold) -> None:
        """Its tenant's spend today has reached a limit: PENDING, held until the reset."""
        self.budget_hold = hold
        self.status.admission = Admission(
            pool=hold.pool,
            held="budget",
            resets_at=hold.resets_at,
            tenant=hold.tenant,
            as_of=workflow.now(),
        )
        if self.status.state in (JobState.QUEUED, JobState.PREPARING, JobState.SUBMITTING):
            self.set_state(JobState.PENDING)
        else:
            self.changed()

    def budget_reset(self) -> None:
        """The budget day it waited for has begun: the job is checked again."""
        self.budget_hold = None
        self.status.admission = None
        self.changed()

    def carry(self) -> BookCarry:
        return BookCarry(budget=self.budget, ran_s=dict(self._ran))

    @property
    def pending(self) -> bool:
        return self.status.state == JobState.PENDING

    @property
    def began_running(self) -> bool:
        """Whether a prompt of the job has begun to run on a GPU, as far as the job has heard
        (a progress report past the provider's queue, or a stored output)."""
        running = (JobState.RUNNING, JobState.RECONNECTING, JobState.UPLOADING)
        return self._began or self.status.state in running or bool(self.status.artifacts)

    @property
    def pool(self) -> str | None:
        """The job's pool: as a prepare or a follow named it, else as the request did (None:
        the worker's default, which the next activity resolves and names)."""
        return self.status.backend.pool if self.status.backend is not None else self._requested

    def begin_segment(self, segment: int, segments: int, sampler_steps: int, nodes: int) -> None:
        self.status.progress = Progress(
            segment=segment,
            segments=segments,
            total_steps=sampler_steps or nodes,
            fraction=segment / segments,
            unit="steps" if sampler_steps else "nodes",
        )
        self.changed()

    def new_submission(self, segment: int, prompt_id: str, total_steps: int) -> Checkpoint:
        """A prompt about to be submitted; recorded before anything is sent, so a cancel
        mid-submit still finds it. A fresh client_id drops any late progress report of an
        earlier submission."""
        client_id = f"dc-{workflow.uuid4()}"
        self.client_id = client_id
        self.prompt_id = prompt_id
        checkpoint = Checkpoint(
            job_id=self.status.job_id,
            segment=segment,
            prompt_id=prompt_id,
            client_id=client_id,
            total_steps=total_steps,
            updated_at=workflow.now(),
        )
        self.status.checkpoint = checkpoint
        if self.status.backend is not None:
            self.status.backend.provider_job_id = prompt_id
        self.backend_state = JobState.RUNNING  # nothing is known of the new prompt yet
        self.status.progress.queue_position = None
        self.mark_progress()
        self.changed()
        return checkpoint

    def submitted(self) -> bool:
        """Did the backend acknowledge the current prompt (as far as the workflow heard)?"""
        checkpoint = self.status.checkpoint
        return (
            checkpoint is not None
            and checkpoint.prompt_id == self.prompt_id
            and checkpoint.submitted_at is not None
        )

    def set_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.status.checkpoint = checkpoint
        self._note_provider_job(checkpoint)
        self.changed()

    def followed(self, result: FollowResult) -> None:
        """The follow saw the prompt end successfully: its outputs, checkpoint and cost."""
        self.finished_prompt = result.prompt_id
        self._began = True
        self._merge(result.artifacts)
        self.status.checkpoint = result.checkpoint
        self._note_provider_job(result.checkpoint)
        for cost in [*result.other_costs, *([result.cost] if result.cost else [])]:
            self._put_cost(cost)
        if self.status.backend is not None and result.worker_id:
            self.status.backend.worker_id = result.worker_id
        self.changed()

    def restart_prompt(self) -> None:
        """The prompt runs again from its first step."""
        self.status.progress.step = 0
        self.changed()

    def end_segment(self) -> None:
        progress = self.status.progress
        progress.step = progress.total_steps
        progress.fraction = (progress.segment + 1) / progress.segments
        self.mark_progress()
        self.changed()

    def reconnecting(self, error: JobError, state: JobState) -> None:
        self.status.reconnects += 1
        self.status.error = error
        self.set_state(state)

    def set_error(self, error: JobError | None) -> None:
        self.status.error = error
        self.changed()

    def decided(self, ending: StopOrder) -> None:
        """How the job ends is settled: counted once, its error recorded. The state follows
        once its prompt is stopped (`set_state`)."""
        counter("jobs_ended", "Jobs by end state").add(1, {"state": ending.state.value})
        self.set_error(ending.error)

    def ask(self, decision: Decision) -> None:
        """Wait for a person: the job is NEEDS_DECISION until a resume or a cancel."""
        self.status.decision = decision
        self.set_state(JobState.NEEDS_DECISION)

    def add_cost(self, cost: JobCost) -> None:
        """A provider job's cost; a later reading of the same job replaces the earlier one."""
        self._put_cost(cost)
        self.changed()

    def merge_artifacts(self, artifacts: list[Artifact]) -> None:
        if self._merge(artifacts):
            self.changed()

    def contact(self) -> None:
        self.contacts += 1
        self.status.last_client_contact_at = workflow.now()
        self.changed()

    def read(
        self, model: type[M], payload: Any, what: str, *, scalar_field: str | None = None
    ) -> M:
        """A signal's payload as `model`; what could not be used is noted (a signal has no
        reply to say it in)."""
        message, notes = lenient_message(model, payload, scalar_field=scalar_field)
        for note in notes:
            self.notice(f"{what}: {note}")
        return message

    def answer(self, resume: ResumeRequest, notes: list[str]) -> None:
        """A `resume` signal: the answer to the job's question, unless garbled (`notes`) or
        no question is asked."""
        self.contact()
        if notes:
            # A decision is not guessed from a garbled message (was `resubmt` meant?).
            self.notice(f"resume: ignored, nothing done: {'; '.join(notes)}")
            return
        if self.status.state != JobState.NEEDS_DECISION:
            self.notice(f"resume: ignored, the job is {self.status.state.value}")
            return
        self.controls.resume = resume

    def notice(self, message: str) -> None:
        """Record a message the job could not use as sent (bounded: the latest ones)."""
        workflow.logger.warning("job %s: %s", self.status.job_id, message)
        notices = self.status.notices
        notices.append(Notice(at=workflow.now(), message=message))
        del notices[:-MAX_NOTICES]
        self.changed()

    # -- the teardown record (workflows/stopping.py keeps it true to what happened) ---------

    def set_teardown(self, teardown: Teardown) -> None:
        self.status.teardown = teardown
        self.changed()

    def nothing_to_stop(self) -> None:
        """The job ends before any prompt of it was submitted."""
        self.set_teardown(
            Teardown(state="SKIPPED", at=workflow.now(), detail="nothing was submitted")
        )

    def teardown_started(self) -> datetime:
        """When the stop began: its first pass, early or settled."""
        record = self.status.teardown
        if record.started_at is None:
            record.started_at = workflow.now()
            self.changed()
        return record.started_at

    def stop_checked(self) -> int:
        """One more check of the stop; how many there have been."""
        self.status.teardown.checks += 1
        self.changed()
        return self.status.teardown.checks

    def add_teardown_step(self, step: TeardownStep) -> None:
        self.status.teardown.steps.append(step)
        self.changed()

    def teardown_waiting(self, detail: str) -> None:
        """The stop goes on: the prompt is not gone yet (or not known to be)."""
        record = self.status.teardown
        record.state = "STOPPING"
        record.detail = detail
        self.changed()

    def end_teardown(
        self, state: Literal["CONFIRMED", "FAILED", "UNCONFIRMED"], detail: str
    ) -> Teardown:
        record = self.status.teardown
        record.state = state
        record.at = workflow.now()
        record.detail = detail
        self.changed()
        return record

    # -- reports from the follow activity ---------------------------------------------------

    def report(self, payload: Any) -> None:
        """A `progress` signal: a report of the current submission's follow, while the job
        runs (a malformed one is noted, a stale or late one dropped)."""
        try:
            report = ProgressReport.model_validate(payload)
        except ValidationError as exc:
            self.notice(f"progress: ignored a malformed report ({exc.error_count()} errors)")
            return
        if report.attempt_client_id != self.client_id or self.status.terminal:
            return  # from a socket of an earlier submission, or too late
        if report.budget is not None:
            self.budgeted(report.budget)
            if report.checkpoint is None and report.slot is None:
                return  # the check's word before it submits: nothing of a prompt yet
        if report.admission is not None and report.slot is not None:
            if self.on_slot_waiting is not None:
                self.on_slot_waiting(report.slot, report.admission)
            return  # in line, nothing sent: the report says nothing of a prompt
        if report.slot is not None and self.on_slot_held is not None:
            self.on_slot_held(report.slot)
        # A stopping job stays STOPPING whatever the backend last said of the prompt.
        self.apply_progress(report, stage_changes=self.controls.stop is None)

    def apply_progress(self, report: ProgressReport, *, stage_changes: bool = False) -> None:
        progress = self.status.progress
        if report.step > progress.step or report.artifact is not None:
            self.mark_progress()
        # Never backwards for the same prompt: a late report from an older socket is stale.
        progress.step = max(progress.step, report.step)
        progress.total_steps = report.total_steps or progress.total_steps
        if progress.total_steps:
            within = min(1.0, progress.step / progress.total_steps)
            fraction = (progress.segment + within) / max(1, progress.segments)
            progress.fraction = max(progress.fraction, fraction)
        if report.checkpoint is not None:
            self.status.checkpoint = report.checkpoint
            self._note_provider_job(report.checkpoint)
        if report.artifact is not None:
            self._merge([report.artifact])
        self.prepared_on(report.pool, report.kind)
        if self.status.backend is not None and report.worker_id:
            self.status.backend.worker_id = report.worker_id
        state_changed = stage_changes and self._apply_stage(report)
        self.changed()
        if state_changed:
            self._upsert(
                STATE_KEY.value_set(self.status.state.value),
                PROGRESS_KEY.value_set(self.coarse_progress()),
            )
        self._upsert_progress()

    def _apply_stage(self, report: ProgressReport) -> bool:
        """A prompt waiting behind others is WAITING (with its place in line), not RUNNING.
        True when that changed the job's state."""
        progress = self.status.progress
        if report.stage == "queued":
            self.backend_state = JobState.WAITING
            progress.queue_position = report.queue_position
        else:
            self.backend_state = JobState.RUNNING
            progress.queue_position = None
            self._began = True
        progress.node = report.node
        following = (JobState.SUBMITTING, JobState.WAITING, JobState.RUNNING)
        if self.status.state in following and self.status.state != self.backend_state:
            return self._put_state(self.backend_state)
        return False

    # -- reading ----------------------------------------------------------------------------

    def events_after(self, since: int) -> JobEvents:
        """The journal after `since` (a seq the caller saw), then the status it leads to."""
        journal = self.journal
        return JobEvents(
            status=self.status,
            events=[entry for entry in journal if entry.seq > since],
            first_seq=journal[0].seq if journal else 0,
        )

    def artifacts_of(self, segment: int) -> list[Artifact]:
        return [a for a in self.status.artifacts if a.segment == segment]

    def coarse_progress(self) -> int:
        return int(self.status.progress.fraction * 10) * 10

    def details(self) -> str:
        """The Temporal UI's "Current Details" of the job as it is now."""
        return self._details.render(self.status)

    def mark_progress(self) -> None:
        """The job moved: the reconnect horizon counts from now (not a status change)."""
        self.last_progress_at = workflow.now()

    # -- the one place the status changes ---------------------------------------------------

    def on_journal(self, listener: Callable[[list[JobEvent]], None]) -> None:
        """Call `listener` with the entries each change journals, within that change (the
        webhook's pending count: a status that reads terminal already counts its ending)."""
        self._journal_listeners.append(listener)

    def changed(self) -> None:
        """Every write to the status ends here, the webhook's bookkeeping's too
        (workflows/webhooks.py)."""
        self.status.seq += 1
        self.status.updated_at = workflow.now()
        entries = self._journal()
        for listener in self._journal_listeners:
            listener(entries)
        # Current details cost no history event: keep the Temporal UI as current as a query.
        workflow.set_current_details(self.details())

    def _journal(self) -> list[JobEvent]:
        """Journal what this change did that a follower must see, under its new seq."""
        status, now = self.status, workflow.now()
        entries: list[JobEvent] = []
        if status.state != self._journaled_state:
            self._journaled_state = status.state
            error = status.error if status.state.terminal else None
            entries.append(
                JobEvent(seq=status.seq, at=now, kind="state", state=status.state, error=error)
            )
        for artifact in status.artifacts[self._journaled_artifacts :]:
            entries.append(
                JobEvent(seq=status.seq, at=now, kind="output_stored", artifact=artifact)
            )
        self._journaled_artifacts = len(status.artifacts)
        percent = self._percent()
        if percent > self._journaled_percent:
            self._journaled_percent = percent
            entries.append(JobEvent(seq=status.seq, at=now, kind="progress", percent=percent))
        if entries:
            self.journal.extend(entries)
            del self.journal[:-MAX_JOURNAL]
        return entries

    def _percent(self) -> int:
        return int(self.status.progress.fraction * 10) * 10

    def _put_state(self, state: JobState) -> bool:
        changed = state != self.status.state
        self.status.state = state
        return changed

    def _put_cost(self, cost: JobCost) -> None:
        costs = self.status.cost
        earlier = next((c for c in costs if c.provider_job_id == cost.provider_job_id), None)
        if earlier is not None and cost.outcome is None:
            # A later reading of the same job (its final figures) keeps what became of it.
            cost = cost.model_copy(update={"outcome": earlier.outcome})
        costs[:] = [c for c in costs if c.provider_job_id != cost.provider_job_id]
        costs.append(cost)
        self.status.deliveries = [Delivery.of(c) for c in costs if c.provider_job_id]
        self._count_gpu()

    def _count_gpu(self) -> None:
        """`gpu_s` and `usd`: what each provider job ran (RunPod's execution, every delivery's)
        and each prompt ran as measured (a comfyui pool); dollars where the pool has a price.
        The idle time RunPod bills after a job's end is in its dollars, not its GPU-seconds:
        the job did not hold the GPU then."""
        costs = self.status.cost
        ran = sum(cost.execution_s for cost in costs) + sum(self._ran.values())
        self.status.gpu_s = round(ran, 3)
        usd = [cost.usd_estimate for cost in costs if cost.usd_estimate is not None]
        self.status.usd = round(sum(usd), 6) if usd else None

    def _merge(self, artifacts: list[Artifact]) -> bool:
        known = {a.key for a in self.status.artifacts}
        added = False
        for artifact in artifacts:
            if artifact.key not in known:
                self.status.artifacts.append(artifact)
                known.add(artifact.key)
                self.mark_progress()
                added = True
        return added

    def _note_provider_job(self, checkpoint: Checkpoint) -> None:
        """The backend's own job id once it names one (RunPod's); ComfyUI's is the prompt id.
        And how long the submission has run, as its follows measured it (a comfyui pool)."""
        submission = checkpoint.client_id
        if submission and checkpoint.ran_s > self._ran.get(submission, 0.0):
            self._ran[submission] = checkpoint.ran_s
            self._count_gpu()
        backend = self.status.backend
        if backend is not None and checkpoint.provider_job_id is not None:
            backend.provider_job_id = checkpoint.provider_job_id
        if checkpoint.server is not None:
            self.ran_on(checkpoint.server)

    def moved(self, from_pool: str, to_pool: str | None, reason: str) -> None:
        """A job of a group left a pool before it started there (`admission.moves`)."""
        move = PoolMove(from_pool=from_pool, to_pool=to_pool, reason=reason, at=workflow.now())
        admission = self.status.admission or Admission(pool=from_pool)
        self.status.admission = admission.model_copy(update={"moves": [*admission.moves, move]})
        workflow.logger.info(
            "job moved to another pool of its group",
            extra={"job_id": self.status.job_id, "from": from_pool, "to": to_pool},
        )
        self.changed()

    def left_pool(self) -> None:
        """Its pool took no work while it waited: the job's next check picks its group's pool
        again (the status names no pool until then)."""
        self.status.backend = None
        self.changed()

    def ran_on(self, server: str) -> None:
        """The server of a pool of many that the job's queue gave it (or its follow sent the
        prompt to): the status names it, and every later activity asks that server."""
        self._server = server
        backend = self.status.backend
        if backend is not None and backend.server != server:
            backend.server = server
            self.changed()

    @property
    def server(self) -> str | None:
        backend = self.status.backend
        if backend is not None and backend.server is not None:
            return backend.server
        return self._server

    def _upsert_progress(self) -> None:
        # Only whole tens: a search-attribute upsert costs history events.
        coarse = self.coarse_progress()
        if coarse != self._last_coarse_progress:
            self._last_coarse_progress = coarse
            self._upsert(PROGRESS_KEY.value_set(coarse))

    def _upsert(self, *updates: SearchAttributeUpdate[Any]) -> None:
        """Held until the workflow task's own code has run: a task that changes state,
        progress and pool writes one history event, not three."""
        idle = not self._unsent_attributes
        for update in updates:
            self._unsent_attributes[update.key.name] = update
        self._attribute_writes += 1
        if idle:
            at_task_end(self.send_search_attributes, lambda: self._attribute_writes)

    def _started_as(self, state: JobState) -> bool:
        started = workflow.info().typed_search_attributes
        return (
            started.get(STATE_KEY) == state.value
            and started.get(PROGRESS_KEY) == self.coarse_progress()
        )

    def send_search_attributes(self) -> None:
        """Upsert what changed; called at the end of each workflow task, and before the run
        ends (a command after the workflow's last one would be dropped)."""
        if self._unsent_attributes:
            updates = list(self._unsent_attributes.values())
            self._unsent_attributes.clear()
            workflow.upsert_search_attributes(updates)


# -- the Temporal UI's "Current Details" of a job: its status at a glance, in Markdown ---------

# Characters Markdown gives a meaning to: escaped, so text from a backend (an error, a node's
# name) renders as text in the UI, never as a link, an image or markup.
_MARKDOWN = frozenset("\\`*_{}[]()<>#+!|~")
MAX_SHOWN_CHARS = 300


class CurrentDetails:
    """Renders one job's details; keeps the pace the ETA is read from."""

    def __init__(self) -> None:
        self._pace_from: tuple[datetime, float] | None = None

    def render(self, status: JobStatus) -> str:
        progress = status.progress
        head = f"**{status.state.value}** — {int(progress.fraction * 100)} %"
        if progress.total_steps:
            head += f" ({progress.step}/{progress.total_steps} {progress.unit}"
            head += f", segment {progress.segment + 1}/{progress.segments})"
        lines = [head]
        if status.state == JobState.WAITING and progress.queue_position is not None:
            lines.append(f"place {progress.queue_position} in the backend's queue")
        admission = status.admission
        if status.state == JobState.PENDING and admission is not None:
            lines.append(plain(place_in_line(admission)))
        eta = self.eta_s(status)
        if eta is not None:
            lines.append(f"about {_duration(eta)} to go")
        if status.backend:
            where = f"pool `{status.backend.pool}`"
            if status.backend.server:
                where += f" on {plain(status.backend.server)}"
            if progress.node and status.state == JobState.RUNNING:
                where += f", node {plain(progress.node)}"
            lines.append(where)
        if status.reconnects:
            lines.append(f"{status.reconnects} reconnect(s)")
        if status.error:
            lines.append(f"error `{status.error.type}`: {plain(status.error.message)}")
        if status.decision and status.state == JobState.NEEDS_DECISION:
            lines.append(f"waiting for a decision: {plain(status.decision.reason)}")
            lines.extend(
                f"- `{choice}`: {what}" for choice, what in status.decision.options.items()
            )
        if status.artifacts:
            lines.append(f"{len(status.artifacts)} artifact(s) stored")
        if status.teardown.state != "PENDING":
            lines.append(f"teardown {status.teardown.state}: {plain(status.teardown.detail)}")
        return "  \n".join(lines)

    def eta_s(self, status: JobStatus) -> float | None:
        """From the pace since the first step was reported; None until there is one."""
        fraction = status.progress.fraction
        if status.state != JobState.RUNNING or fraction >= 1.0:
            return None
        if self._pace_from is None:
            if fraction > 0:
                self._pace_from = (workflow.now(), fraction)
            return None
        since, start = self._pace_from
        done = fraction - start
        if done < 0.02:
            return None
        elapsed = (workflow.now() - since).total_seconds()
        return elapsed / done * (1.0 - fraction)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plain(text: str) -> str:
    """`text` as plain text inside Markdown: one line, escaped, at most MAX_SHOWN_CHARS."""
    cut = text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"
    return "".join("\\" + ch if ch in _MARKDOWN else ch if ch.isprintable() else " " for ch in cut)
