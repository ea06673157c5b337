"""The job's status and the bookkeeping every change to it needs.

Each change bumps `seq` and `updated_at`; state changes (only) upsert the `JobState` and
`JobProgress` search attributes and the current details, so the Temporal UI shows the job at a
glance without a history event per progress step.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.common import SearchAttributeKey

with workflow.unsafe.imports_passed_through():
    from workflows.contracts import Artifact, JobState, JobStatus, ProgressReport
    from workflows.shared import SA_JOB_POOL, SA_JOB_PROGRESS, SA_JOB_STATE

STATE_KEY = SearchAttributeKey.for_keyword(SA_JOB_STATE)
PROGRESS_KEY = SearchAttributeKey.for_int(SA_JOB_PROGRESS)
POOL_KEY = SearchAttributeKey.for_keyword(SA_JOB_POOL)


class JobBook:
    def __init__(self, status: JobStatus) -> None:
        self.status = status
        # When the job last moved (a step, an artifact, a submission): the reconnect horizon
        # counts from here.
        self.last_progress_at = workflow.now()
        self._last_coarse_progress = -1
        # Where the backend last said the prompt is: waiting in its queue, or running.
        self.backend_state = JobState.RUNNING

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

    def set_state(self, state: JobState) -> None:
        changed = state != self.status.state
        self.status.state = state
        self.touch()
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
        status = self.status
        lines = [f"**{status.state.value}** — {int(status.progress.fraction * 100)} %"]
        if status.state == JobState.WAITING and status.progress.queue_position is not None:
            lines.append(f"place {status.progress.queue_position} in the backend's queue")
        if status.backend:
            lines.append(f"pool `{status.backend.pool}`")
        if status.reconnects:
            lines.append(f"{status.reconnects} reconnect(s)")
        if status.error:
            lines.append(f"error `{status.error.type}`: {status.error.message}")
        if status.artifacts:
            lines.append(f"{len(status.artifacts)} artifact(s) stored")
        if status.teardown.state != "PENDING":
            lines.append(f"teardown {status.teardown.state}: {status.teardown.detail}")
        return "  \n".join(lines)
