"""The job's status, and the one owner of every change to it.

Every change goes through a method here and bumps `seq` and `updated_at` (clients' `watch`
relies on it) and refreshes the current details; state changes (only) upsert the `JobState` and
`JobProgress` search attributes, so the Temporal UI shows the job at a glance without a history
event per progress step.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts import (
        MAX_NOTICES,
        Artifact,
        BackendInfo,
        Checkpoint,
        Decision,
        JobCost,
        JobError,
        JobState,
        JobStatus,
        Notice,
        Progress,
        ProgressReport,
        Teardown,
    )
    from workflows.shared import POOL_KEY, PROGRESS_KEY, STATE_KEY


class JobBook:
    def __init__(self, status: JobStatus) -> None:
        self.status = status
        # When the job last moved (a step, an artifact, a submission): the reconnect horizon
        # counts from here.
        self.last_progress_at = workflow.now()
        self._last_coarse_progress = -1
        # Where the backend last said the prompt is: waiting in its queue, or running.
        self.backend_state = JobState.RUNNING
        self._pace_from: tuple[datetime, float] | None = None
        # The current submission: progress reports from any other socket are stale.
        checkpoint = status.checkpoint
        self.prompt_id: str | None = checkpoint.prompt_id if checkpoint else None
        self.client_id: str | None = None
        # A prompt whose successful end the follow activity saw on the backend: nothing of it
        # runs any more, so a completed job's teardown needs no check of its own.
        self.finished_prompt: str | None = None
        # Messages from clients: the abandon watchdog waits for this to move.
        self.contacts = 0

    # -- the run --------------------------------------------------------------------------

    def prepared_on(self, pool: str, kind: str) -> None:
        self.status.backend = BackendInfo(pool=pool, kind=kind)
        workflow.upsert_search_attributes([POOL_KEY.value_set(pool)])
        self.touch()

    def begin_segment(self, segment: int, segments: int, sampler_steps: int, nodes: int) -> None:
        self.status.progress = Progress(
            segment=segment,
            segments=segments,
            total_steps=sampler_steps or nodes,
            fraction=segment / segments,
            unit="steps" if sampler_steps else "nodes",
        )
        self.touch()

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
        self.touch()
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
        self.touch()

    def _note_provider_job(self, checkpoint: Checkpoint) -> None:
        """The backend's own job id once it names one (RunPod's); ComfyUI's is the prompt id."""
        backend = self.status.backend
        if backend is not None and checkpoint.provider_job_id is not None:
            backend.provider_job_id = checkpoint.provider_job_id

    def restart_prompt(self) -> None:
        """The prompt runs again from its first step."""
        self.status.progress.step = 0
        self.touch()

    def end_segment(self) -> None:
        progress = self.status.progress
        progress.step = progress.total_steps
        progress.fraction = (progress.segment + 1) / progress.segments
        self.mark_progress()
        self.touch()

    def reconnecting(self, error: JobError, state: JobState) -> None:
        self.status.reconnects += 1
        self.status.error = error
        self.set_state(state)

    def set_error(self, error: JobError | None) -> None:
        self.status.error = error
        self.touch()

    def ask(self, decision: Decision) -> None:
        """Wait for a person: the job is NEEDS_DECISION until a resume or a cancel."""
        self.status.decision = decision
        self.set_state(JobState.NEEDS_DECISION)

    def add_cost(self, cost: JobCost) -> None:
        """A provider job's cost; a later reading of the same job replaces the earlier one."""
        costs = self.status.cost
        costs[:] = [c for c in costs if c.provider_job_id != cost.provider_job_id]
        costs.append(cost)
        self.touch()

    def set_teardown(self, teardown: Teardown) -> None:
        self.status.teardown = teardown
        self.touch()

    def contact(self) -> None:
        self.contacts += 1
        self.status.last_client_contact_at = workflow.now()
        self.touch()

    # -- reports from the follow activity ---------------------------------------------------

    def apply_progress(self, report: ProgressReport, *, stage_changes: bool = False) -> None:
        progress = self.status.progress
        if report.step > progress.step or report.artifact is not None:
            self.mark_progress()
        # Never backwards for the same prompt: a late report from an older socket is stale.
        progress.step = max(progress.step, report.step)
        progress.total_steps = report.total_steps or progress.total_steps
        if progress.total_steps:
            within = min(1.0, report.step / progress.total_steps)
            progress.fraction = (progress.segment + within) / max(1, progress.segments)
        if report.checkpoint is not None:
            self.status.checkpoint = report.checkpoint
            self._note_provider_job(report.checkpoint)
        if report.artifact is not None:
            self.merge_artifacts([report.artifact])
        if self.status.backend is not None and report.worker_id:
            self.status.backend.worker_id = report.worker_id
        self.touch()
        if stage_changes:
            self._apply_stage(report)
        self._upsert_progress()

    def _apply_stage(self, report: ProgressReport) -> None:
        """A prompt waiting behind others is WAITING (with its place in line), not RUNNING."""
        progress = self.status.progress
        if report.stage == "queued":
            self.backend_state = JobState.WAITING
            progress.queue_position = report.queue_position
        else:
            self.backend_state = JobState.RUNNING
            progress.queue_position = None
        progress.node = report.node
        following = (JobState.SUBMITTING, JobState.WAITING, JobState.RUNNING)
        if self.status.state in following and self.status.state != self.backend_state:
            self.set_state(self.backend_state)

    def notice(self, message: str) -> None:
        """Record a message the job could not use as sent (bounded: the latest ones)."""
        workflow.logger.warning("job %s: %s", self.status.job_id, message)
        notices = self.status.notices
        notices.append(Notice(at=workflow.now(), message=message))
        del notices[:-MAX_NOTICES]
        self.touch()

    def mark_progress(self) -> None:
        self.last_progress_at = workflow.now()

    def merge_artifacts(self, artifacts: list[Artifact]) -> None:
        known = {a.key for a in self.status.artifacts}
        for artifact in artifacts:
            if artifact.key not in known:
                self.status.artifacts.append(artifact)
                known.add(artifact.key)
                self.mark_progress()

    def artifacts_of(self, segment: int) -> list[Artifact]:
        return [a for a in self.status.artifacts if a.segment == segment]

    def touch(self) -> None:
        self.status.seq += 1
        self.status.updated_at = workflow.now()
        # Current details cost no history event: keep the Temporal UI as current as a query.
        workflow.set_current_details(self.details())

    def set_state(self, state: JobState) -> None:
        changed = state != self.status.state
        self.status.state = state
        self.touch()
        # seq 1: the status's very first write (a run's start, unless a message came first).
        if changed or self.status.seq == 1:
            workflow.upsert_search_attributes(
                [STATE_KEY.value_set(state.value), PROGRESS_KEY.value_set(self.coarse_progress())]
            )
        workflow.set_current_details(self.details())

    def coarse_progress(self) -> int:
        return int(self.status.progress.fraction * 10) * 10

    def _upsert_progress(self) -> None:
        # Only whole tens: a search-attribute upsert costs history events.
        coarse = self.coarse_progress()
        if coarse != self._last_coarse_progress:
            self._last_coarse_progress = coarse
            workflow.upsert_search_attributes([PROGRESS_KEY.value_set(coarse)])

    def details(self) -> str:
        """The Temporal UI's "Current Details": the job at a glance, in Markdown."""
        status = self.status
        progress = status.progress
        head = f"**{status.state.value}** — {int(progress.fraction * 100)} %"
        if progress.total_steps:
            head += f" ({progress.step}/{progress.total_steps} {progress.unit}"
            head += f", segment {progress.segment + 1}/{progress.segments})"
        lines = [head]
        if status.state == JobState.WAITING and progress.queue_position is not None:
            lines.append(f"place {progress.queue_position} in the backend's queue")
        eta = self._eta_s()
        if eta is not None:
            lines.append(f"about {_duration(eta)} to go")
        if status.backend:
            where = f"pool `{status.backend.pool}`"
            if progress.node and status.state == JobState.RUNNING:
                where += f", node {_plain(progress.node)}"
            lines.append(where)
        if status.reconnects:
            lines.append(f"{status.reconnects} reconnect(s)")
        if status.error:
            lines.append(f"error `{status.error.type}`: {_plain(status.error.message)}")
        if status.decision and status.state == JobState.NEEDS_DECISION:
            lines.append(f"waiting for a decision: {_plain(status.decision.reason)}")
            lines.extend(
                f"- `{choice}`: {what}" for choice, what in status.decision.options.items()
            )
        if status.artifacts:
            lines.append(f"{len(status.artifacts)} artifact(s) stored")
        if status.teardown.state != "PENDING":
            lines.append(f"teardown {status.teardown.state}: {_plain(status.teardown.detail)}")
        return "  \n".join(lines)

    def _eta_s(self) -> float | None:
        """From the pace since the first step was reported; None until there is one."""
        fraction = self.status.progress.fraction
        if self.status.state != JobState.RUNNING or fraction >= 1.0:
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


# Characters Markdown gives a meaning to: escaped, so text from a backend (an error, a node's
# name) renders as text in the UI, never as a link, an image or markup.
_MARKDOWN = frozenset("\\`*_{}[]()<>#+!|~")
MAX_SHOWN_CHARS = 300


def _plain(text: str) -> str:
    """`text` as plain text inside Markdown: one line, escaped, at most MAX_SHOWN_CHARS."""
    cut = text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"
    return "".join("\\" + ch if ch in _MARKDOWN else ch if ch.isprintable() else " " for ch in cut)
