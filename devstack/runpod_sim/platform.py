"""The control plane: what RunPod does between the public API and the workers. Scaling from
zero, handing jobs out, the execution timeout, TTL and result retention, idle scale-down, and
what happens to a job when its worker dies. Routes and the timer loop call in here; everything
runs on the event loop, so no locks."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from .clock import SimClock
from .faults import FaultState
from .jobs import Job, JobTable
from .models import RunRequest
from .settings import DeathOutcome, SimSettings
from .worker_faults import WorkerFaults
from .workers import Worker, WorkerPool

log = structlog.get_logger("runpod_sim.platform")

# The timer loop's period in real seconds: the resolution of every simulated timer.
TICK_S = 0.05
# Real seconds, at most, between launches after workers keep dying during their boot.
MAX_BOOT_BACKOFF_S = 30.0


class Platform:
    def __init__(
        self,
        settings: SimSettings,
        clock: SimClock,
        table: JobTable,
        pool: WorkerPool,
        faults: FaultState,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.table = table
        self.pool = pool
        self.faults = faults
        self.worker_faults = WorkerFaults(clock)
        self.shutting_down = False
        # Workers that died before asking for work (a broken command, a failed fitness check):
        # new launches back off, so a broken handler is not respawned in a tight loop.
        self.boot_failures = 0
        self.launch_not_before = 0.0

    # -- the public side -----------------------------------------------------------------------

    def submit(self, request: RunRequest, sync: bool) -> Job:
        job = self.table.create(request, sync)
        self.autoscale()  # scale from zero on submission, not at the next tick
        return job

    def cancel(self, job: Job) -> None:
        worker_id = job.worker_id if job.status == "IN_PROGRESS" else None
        self.table.finish(job, "CANCELLED", outcome="cancelled")
        if worker_id is not None:
            self._stop_job_on(worker_id, job.id)

    def retry(self, job: Job) -> bool:
        retried = self.table.retry(job)
        if retried:
            self.autoscale()
        return retried

    def health(self) -> dict[str, Any]:
        jobs = self.table
        alive = self.pool.alive()
        healthy = [w for w in alive if not self.unhealthy(w)]
        count = {state: sum(1 for w in healthy if w.state == state) for state in
                 ("initializing", "idle", "running")}  # fmt: skip
        throttled = self._launches_wanted() if self.throttled() else 0
        return {
            "jobs": {
                "completed": jobs.completed,
                "failed": jobs.failed,
                "inProgress": len(jobs.in_progress()),
                "inQueue": len(jobs.queue),
                "retried": jobs.retried,
            },
            "workers": {
                "idle": count["idle"],
                "initializing": count["initializing"],
                # The simulator's reading: workers past initialization, busy or not.
                "ready": count["idle"] + count["running"],
                "running": count["running"],
                "throttled": throttled,
                "unhealthy": len(alive) - len(healthy),
            },
        }

    # -- the worker-state faults (faults.py) ---------------------------------------------------

    def unhealthy(self, worker: Worker) -> bool:
        """Failing its health check (the `unhealthy_workers` fault): a live worker holding no
        job. One running a job runs it to its end, then is unhealthy."""
        return self.faults.armed.unhealthy_workers and worker.state in ("initializing", "idle")

    def throttled(self) -> bool:
        """No GPU free for a new worker (the `throttled_workers` fault)."""
        return self.faults.armed.throttled_workers and not self.shutting_down

    # -- the worker side -----------------------------------------------------------------------

    def can_take(self, worker: Worker) -> bool:
        return worker.alive and not self.shutting_down and not self.faults.armed.unhealthy_workers

    def worker_polled(self, worker: Worker, job_in_progress: bool) -> None:
        """A job-take request: the worker is ready; with job_in_progress=0 it holds no job."""
        now = self.clock.now()
        if worker.state == "initializing":
            self.boot_failures = 0
            worker.ready_at = now
            worker.state = "idle"
            worker.idle_since = now
            log.info("worker ready", worker_id=worker.id, boot_s=round(now - worker.started_at, 3))
        if not job_in_progress and worker.jobs:
            # A job it never reported (a cancelled one, or a job-done that never arrived) is
            # no longer on this worker; the job itself waits for its execution timeout.
            for job_id in list(worker.jobs):
                self._job_left(worker, job_id)

    def take(self, worker: Worker, count: int) -> list[Job]:
        taken: list[Job] = []
        while len(taken) < count and self.can_take(worker):
            job = self.table.take(worker.id)
            if job is None:
                break
            worker.jobs.add(job.id)
            worker.job_history.append(job.id)
            worker.state = "running"
            worker.idle_since = None
            delivery = job.deliveries[-1]
            delivery.plans = self.faults.take_plans(self.clock.now(), worker.id, job.id)
            taken.append(job)
        return taken

    def active_on(self, worker: Worker, job_id: str) -> Job | None:
        """The job if this worker is the one running it now, else None (a late or stray post)."""
        job = self.table.jobs.get(job_id)
        if job is None or job.gone or job.status != "IN_PROGRESS" or job.worker_id != worker.id:
            return None
        return job

    def progress(self, worker: Worker, job: Job, output: Any) -> None:
        job.progress, job.has_progress = output, True
        delivery = job.delivery
        assert delivery is not None
        delivery.progress_updates += 1
        artifacts = _artifacts_in(output)
        delivery.artifacts_reported = max(delivery.artifacts_reported, artifacts)
        stage = output.get("stage") if isinstance(output, dict) else None
        if isinstance(stage, str):
            delivery.updates_in_stage[stage] = delivery.updates_in_stage.get(stage, 0) + 1
            delivery.artifacts_in_stage[stage] = max(
                delivery.artifacts_in_stage.get(stage, 0), artifacts
            )
        self._fire_due(job)
        self.table.changes.notify()

    def stream_chunk(self, job: Job, chunk: Any) -> None:
        job.stream.append(chunk)
        delivery = job.delivery
        if delivery is not None:
            delivery.stream_chunks += 1
        self.table.changes.notify()

    def result(self, worker: Worker, job: Job, body: dict[str, Any]) -> None:
        """A final job-done post."""
        if body.get("error"):
            self.table.finish(
                job,
                "FAILED",
                outcome="failed",
                error=body["error"],
                output=body.get("output"),
                has_output="output" in body,
            )
        else:
            self.table.finish(
                job,
                "COMPLETED",
                outcome="completed",
                output=body.get("output"),
                has_output="output" in body,
            )
        self._job_left(worker, job.id)
        if body.get("stopPod"):
            # refresh_worker: the SDK keeps running; the platform replaces the worker.
            self.pool.stop_soon(worker, "refresh")

    def lose_result(self, worker: Worker, job: Job, why: str, stop_pod: bool = False) -> None:
        """A refused job-done: RunPod reports the job COMPLETED without output."""
        log.warning("job-done refused, job completes without output", job_id=job.id, why=why)
        self.table.finish(job, "COMPLETED", outcome="result_lost", note=why)
        self._job_left(worker, job.id)
        if stop_pod:
            self.pool.stop_soon(worker, "refresh")

    def _job_left(self, worker: Worker, job_id: str) -> None:
        if job_id not in worker.jobs:
            return
        worker.jobs.discard(job_id)
        worker.to_stop.pop(job_id, None)
        now = self.clock.now()
        worker.last_job_end_at = now
        if not worker.jobs and worker.state == "running":
            worker.state = "idle"
            worker.idle_since = now
        self.table.changes.notify()

    def _stop_job_on(self, worker_id: str, job_id: str) -> None:
        """Queue a job-stop signal for the worker (`{"jobsToStop": [...]}` on its next poll)."""
        worker = self.pool.workers.get(worker_id)
        if worker is not None and worker.alive and job_id in worker.jobs:
            worker.to_stop.setdefault(job_id, None)
            self.table.changes.notify()

    def _fire_due(self, job: Job) -> None:
        """Fire the delivery's fault plans that are due (faults.py, worker_faults.py)."""
        delivery = job.delivery
        worker = self.pool.workers.get(job.worker_id or "")
        if delivery is None or worker is None or not delivery.plans:
            return
        now = self.clock.now()
        due = [p for p in delivery.plans if p.due(now, *delivery.heard(p.in_stage))]
        for plan in due:
            delivery.plans.remove(plan)
            if plan.kind == "crash":
                self.pool.crash(worker, plan.outcome or self.settings.worker_death, job.id)
            elif plan.kind == "freeze":
                self.worker_faults.freeze(worker, job.id, plan)
            else:
                self.worker_faults.partition(worker, job.id, plan)
        if due:
            self.table.changes.notify()

    # -- a worker is gone ----------------------------------------------------------------------

    def on_worker_exit(self, worker: Worker) -> None:
        died = worker.stop_reason in ("crash", "watchdog", "exited", "start_failed")
        if died and worker.ready_at is None:
            self.boot_failures += 1
            backoff = min(MAX_BOOT_BACKOFF_S, 0.5 * 2**self.boot_failures)
            self.launch_not_before = time.monotonic() + backoff
            log.error(
                "worker died before taking work; see its log",
                worker_id=worker.id,
                exit_code=worker.exit_code,
                log=str(worker.log_path),
                next_launch_in_s=backoff,
            )
        outcome: DeathOutcome = worker.death_outcome or self.settings.worker_death
        if died and worker.jobs:
            # Its jobs ended on it when it died: the time since the job before is work, not
            # idle time (a crash a few seconds into a job is no idle bill).
            worker.last_job_end_at = worker.billing_end() or self.clock.now()
        for job_id in sorted(worker.jobs):
            job = self.table.jobs.get(job_id)
            if job is None or job.gone or job.status != "IN_PROGRESS" or job.worker_id != worker.id:
                continue
            if not died:
                continue  # stopped by the platform (shutdown): the job stays as it is
            self._worker_lost(job, outcome)
        worker.jobs.clear()
        worker.to_stop.clear()
        if not self.shutting_down:
            self.autoscale()

    def _worker_lost(self, job: Job, outcome: DeathOutcome) -> None:
        log.warning("worker lost mid-job", job_id=job.id, worker_id=job.worker_id, outcome=outcome)
        if outcome == "timed_out":
            self.table.finish(
                job,
                "TIMED_OUT",
                outcome="worker_lost",
                error="worker lost while running the job (simulated)",
                note="worker lost",
            )
        elif outcome == "redeliver":
            self.table.requeue(job, "re-delivery after worker loss")
        # "stuck": IN_PROGRESS on a dead worker until the execution timeout.

    # -- timers --------------------------------------------------------------------------------

    def tick(self) -> None:
        now = self.clock.now()
        for job in self.table.expired(now):
            if job.status == "IN_PROGRESS" and job.worker_id is not None:
                # As for a cancel: the worker is told to stop it and counts as busy until it
                # asks for work again.
                self._stop_job_on(job.worker_id, job.id)
            self.table.delete(job, "ttl")
        for job in self.table.over_execution_timeout(now):
            self._execution_timeout(job)
        for job in self.table.retention_over(now):
            self.table.delete(job, "retention")
        for job in self.table.in_progress():
            self._fire_due(job)
        self.worker_faults.tick(list(self.pool.workers.values()))
        self._scale_down_idle(now)
        self.autoscale()

    def _execution_timeout(self, job: Job) -> None:
        """Exceeding executionTimeout fails the job and stops the worker."""
        worker = self.pool.workers.get(job.worker_id or "")
        self.table.finish(
            job,
            self.settings.execution_timeout_status,
            outcome="execution_timeout",
            error=f"execution timeout exceeded ({job.execution_timeout_s:g} s)",
            note="execution timeout",
        )
        if worker is not None and worker.alive and job.id in worker.jobs:
            self._stop_job_on(worker.id, job.id)
            self.pool.stop_soon(worker, "execution_timeout")
            worker.jobs.discard(job.id)  # its stop signal stays due: the worker is going anyway
            worker.last_job_end_at = self.clock.now()

    def _scale_down_idle(self, now: float) -> None:
        """Stop workers idle for the idle timeout, keeping the active (min) workers."""
        alive = len(self.pool.alive())
        for worker in self.pool.alive():
            if alive <= self.settings.min_workers:
                return
            if worker.state == "idle" and worker.idle_since is not None:
                if now - worker.idle_since >= self.settings.idle_timeout_s:
                    self.pool.stop_soon(worker, "idle")
                    alive -= 1

    def autoscale(self) -> None:
        """Start workers for queued jobs that no idle or booting worker will take, and up to
        the active (min) workers; none while throttled (`/health` counts them instead)."""
        if self.shutting_down or time.monotonic() < self.launch_not_before or self.throttled():
            return
        for _ in range(self._launches_wanted()):
            self.pool.launch(self.faults.take_cold_start_extra())

    def _launches_wanted(self) -> int:
        """How many workers the autoscaler wants started now. An unhealthy worker is no
        capacity; it still counts towards max workers."""
        alive = self.pool.alive()
        available = sum(
            1 for w in alive if w.state in ("initializing", "idle") and not self.unhealthy(w)
        )
        needed = max(len(self.table.queue) - available, self.settings.min_workers - len(alive))
        room = self.settings.max_workers - len(alive)
        return max(0, min(needed, room))

    async def run_timers(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a bug in one tick must not stop every timer for good
                log.exception("timer tick failed")
            await asyncio.sleep(TICK_S)

    async def shutdown(self) -> None:
        self.shutting_down = True
        self.table.changes.notify()
        await self.pool.shutdown()


def _artifacts_in(output: Any) -> int:
    """How many stored outputs a progress update reports (our handler's `artifacts`, with the
    oldest left out counted); 0 for anything else."""
    if not isinstance(output, dict) or not isinstance(output.get("artifacts"), list):
        return 0
    omitted = output.get("artifacts_omitted")
    return len(output["artifacts"]) + (omitted if isinstance(omitted, int) else 0)
