"""Jobs and the queue: every state change of a job goes through JobTable, which records it (with
its simulator time) for the ledger and wakes the long-polls waiting on it.

A job that RunPod would delete (TTL expired, result retention over, purged) stays in the table,
marked `gone`: the public API answers 404 for it, the ledger still shows it.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from .clock import Changes, SimClock
from .models import RETRYABLE, TERMINAL, JobStatus, RunRequest, submission_token
from .settings import DeathOutcome, SimSettings

log = structlog.get_logger("runpod_sim.jobs")


@dataclass
class StateEntry:
    status: str
    at: float
    note: str | None = None


# The faults armed on a job delivery (faults.py): kill -9 the worker, SIGSTOP its handler's
# process group, or cut it off from S3.
DeliveryFaultKind = Literal["crash", "freeze", "partition"]


@dataclass
class FaultPlan:
    """A fault armed on one delivery: it fires at `at` (simulator time) or once
    `after_progress` progress updates arrived, whichever comes first."""

    kind: DeliveryFaultKind
    at: float | None = None
    after_progress: int | None = None
    # Once a progress update says this many outputs were stored (our handler's updates list
    # them): a worker lost between its uploads, or after them but before its outcome.
    after_artifacts: int | None = None
    # Only progress updates at this stage count towards after_progress and after_artifacts
    # (our handler reports "uploading" once its claim holds the prompt's end).
    in_stage: str | None = None
    # crash: what its job becomes; freeze/partition: what it becomes should the worker die
    # meanwhile (its watchdog killing it); None: --worker-death.
    outcome: DeathOutcome | None = None
    # freeze: SIGCONT this many simulator seconds later; partition: reopen its S3 (None: for
    # as long as the worker lives).
    lasts_s: float | None = None

    def due(self, now: float, progress_updates: int, artifacts: int = 0) -> bool:
        if self.at is not None and now >= self.at:
            return True
        if self.after_artifacts is not None and artifacts >= self.after_artifacts:
            return True
        return self.after_progress is not None and progress_updates >= self.after_progress


@dataclass
class Delivery:
    """One hand-over of a job to a worker (a retry or a re-delivery makes another)."""

    worker_id: str
    taken_at: float
    ended_at: float | None = None
    outcome: str | None = None
    progress_updates: int = 0
    # The most stored outputs a progress update of this delivery reported.
    artifacts_reported: int = 0
    # Per stage of the updates (their `stage`): how many, and the most outputs one reported.
    updates_in_stage: dict[str, int] = field(default_factory=dict)
    artifacts_in_stage: dict[str, int] = field(default_factory=dict)
    stream_chunks: int = 0
    plans: list[FaultPlan] = field(default_factory=list)

    def heard(self, stage: str | None) -> tuple[int, int]:
        """Progress updates and the most stored outputs reported: in all, or at `stage`."""
        if stage is None:
            return self.progress_updates, self.artifacts_reported
        return self.updates_in_stage.get(stage, 0), self.artifacts_in_stage.get(stage, 0)

    def billed_s(self, now: float) -> float:
        return (self.ended_at if self.ended_at is not None else now) - self.taken_at


@dataclass
class Job:
    id: str
    input: Any
    execution_timeout_s: float
    ttl_s: float
    sync: bool
    webhook: str | None
    submitted_at: float
    submission: str | None
    queued_at: float
    status: JobStatus = "IN_QUEUE"
    started_at: float | None = None
    finished_at: float | None = None
    worker_id: str | None = None
    output: Any = None
    has_output: bool = False
    error: Any = None
    progress: Any = None
    has_progress: bool = False
    stream: list[Any] = field(default_factory=list)
    stream_sent: int = 0
    deliveries: list[Delivery] = field(default_factory=list)
    states: list[StateEntry] = field(default_factory=list)
    retries: int = 0
    gone: str | None = None
    late_posts: int = 0
    webhook_answers: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def delivery(self) -> Delivery | None:
        """The delivery running now (None unless IN_PROGRESS)."""
        if self.status != "IN_PROGRESS" or not self.deliveries:
            return None
        return self.deliveries[-1]


class JobTable:
    def __init__(self, settings: SimSettings, clock: SimClock) -> None:
        self.settings = settings
        self.clock = clock
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.changes = Changes()
        self.completed = 0
        self.failed = 0
        self.retried = 0
        # Called once per terminal transition (webhooks).
        self.on_terminal: list[Callable[[Job], None]] = []

    # -- reads ---------------------------------------------------------------------------------

    def visible(self, job_id: str) -> Job | None:
        """The job as the public API sees it: None once deleted (404)."""
        job = self.jobs.get(job_id)
        return None if job is None or job.gone else job

    def in_progress(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.status == "IN_PROGRESS" and not j.gone]

    # -- transitions ---------------------------------------------------------------------------

    def _record(self, job: Job, status: JobStatus, note: str | None = None) -> None:
        job.status = status
        job.states.append(StateEntry(status, self.clock.now(), note))
        log.info("job state", job_id=job.id, status=status, note=note)
        self.changes.notify()

    def create(self, request: RunRequest, sync: bool) -> Job:
        now = self.clock.now()
        policy = request.policy
        timeout_ms = (
            policy and policy.executionTimeout
        ) or self.settings.default_execution_timeout_ms
        ttl_ms = (policy and policy.ttl) or self.settings.default_ttl_ms
        # RunPod's ids are a UUID and a region suffix ("-u1"); ours say where they come from.
        job = Job(
            id=f"{uuid.uuid4()}-sim",
            input=request.input,
            execution_timeout_s=timeout_ms / 1000,
            ttl_s=ttl_ms / 1000,
            sync=sync,
            webhook=request.webhook,
            submitted_at=now,
            submission=submission_token(request.input),
            queued_at=now,
        )
        self.jobs[job.id] = job
        self.queue.append(job.id)
        self._record(job, "IN_QUEUE", "runsync" if sync else "run")
        return job

    def take(self, worker_id: str) -> Job | None:
        """Hand the first queued job to a worker."""
        while self.queue:
            job = self.jobs[self.queue.popleft()]
            if job.status != "IN_QUEUE" or job.gone:
                continue
            now = self.clock.now()
            job.started_at = now
            job.worker_id = worker_id
            job.has_progress, job.progress = False, None
            job.deliveries.append(Delivery(worker_id, now))
            self._record(job, "IN_PROGRESS", f"worker {worker_id}")
            return job
        return None

    def _end_delivery(self, job: Job, outcome: str) -> None:
        delivery = job.delivery
        if delivery is not None:
            delivery.ended_at = self.clock.now()
            delivery.outcome = outcome

    def finish(
        self,
        job: Job,
        status: JobStatus,
        *,
        outcome: str,
        output: Any = None,
        has_output: bool = False,
        error: Any = None,
        note: str | None = None,
    ) -> None:
        """Move a queued or running job to a terminal state."""
        if job.terminal or job.gone:
            return
        if job.status == "IN_QUEUE":
            self._unqueue(job)
        self._end_delivery(job, outcome)
        job.finished_at = self.clock.now()
        job.output, job.has_output, job.error = output, has_output, error
        if status == "COMPLETED":
            self.completed += 1
        elif status in ("FAILED", "TIMED_OUT"):
            self.failed += 1
        self._record(job, status, note)
        for listener in self.on_terminal:
            listener(job)

    def requeue(self, job: Job, note: str) -> None:
        """A re-delivery: the job goes back to the front of the queue, same id."""
        self._end_delivery(job, "worker_lost")
        job.worker_id = None
        job.started_at = None
        job.queued_at = self.clock.now()
        self.queue.appendleft(job.id)
        self._record(job, "IN_QUEUE", note)

    def retry(self, job: Job) -> bool:
        """POST /retry: FAILED or TIMED_OUT only; same id, back to IN_QUEUE."""
        if job.status not in RETRYABLE:
            return False
        job.retries += 1
        self.retried += 1
        job.worker_id = None
        job.started_at = job.finished_at = None
        job.output, job.has_output, job.error = None, False, None
        job.stream.clear()
        job.stream_sent = 0
        job.queued_at = self.clock.now()
        self.queue.append(job.id)
        self._record(job, "IN_QUEUE", "retry")
        return True

    def _unqueue(self, job: Job) -> None:
        try:
            self.queue.remove(job.id)
        except ValueError:
            pass

    def delete(self, job: Job, reason: str) -> None:
        """RunPod deletes the job: TTL over, retention over, or purged. /status answers 404."""
        if job.gone:
            return
        if job.status == "IN_QUEUE":
            self._unqueue(job)
        self._end_delivery(job, reason)
        job.gone = reason
        job.states.append(StateEntry(f"DELETED:{reason}", self.clock.now()))
        log.info("job deleted", job_id=job.id, reason=reason)
        self.changes.notify()

    def purge_queue(self) -> int:
        removed = 0
        for job_id in list(self.queue):
            job = self.jobs[job_id]
            if job.status == "IN_QUEUE" and not job.gone:
                self.delete(job, "purged")
                removed += 1
        self.queue.clear()
        return removed

    # -- timers --------------------------------------------------------------------------------

    def expired(self, now: float) -> list[Job]:
        """Jobs past their TTL (counted from submission, whatever their state)."""
        return [j for j in self.jobs.values() if not j.gone and now >= j.submitted_at + j.ttl_s]

    def retention_over(self, now: float) -> list[Job]:
        out = []
        for job in self.jobs.values():
            if job.gone or not job.terminal or job.finished_at is None:
                continue
            keep = self.settings.runsync_retention_s if job.sync else self.settings.run_retention_s
            if now >= job.finished_at + keep:
                out.append(job)
        return out

    def over_execution_timeout(self, now: float) -> list[Job]:
        return [
            j
            for j in self.in_progress()
            if j.started_at is not None and now >= j.started_at + j.execution_timeout_s
        ]
