"""GET /sim/ledger: the simulator's bill. Every job (its submission token, every state with its
time, the worker of each delivery, billed seconds) and every worker (started, stopped, billed
seconds, why it stopped), so tests can prove nothing ran twice, nothing was paid for twice and
nothing was left running.

All times are simulator seconds since the simulator started (`now` is the current one); billed
seconds are simulator seconds too. These models are the ledger's schema: tests read it back with
`Ledger.model_validate(...)`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .clock import SimClock
from .jobs import Delivery, Job, JobTable
from .settings import SIM_VERSION, SimSettings
from .workers import Worker, WorkerPool


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class LedgerState(BaseModel):
    status: str  # a RunPod state, or DELETED:ttl / DELETED:retention / DELETED:purged
    at: float
    note: str | None = None


class LedgerDelivery(BaseModel):
    worker_id: str
    taken_at: float
    ended_at: float | None
    # completed, failed, cancelled, execution_timeout, worker_lost, result_lost, ttl, or None
    # while running
    outcome: str | None
    progress_updates: int
    stream_chunks: int
    billed_s: float


class LedgerJob(BaseModel):
    id: str
    submission: str | None
    sync: bool
    status: str
    gone: str | None  # why /status answers 404 now: ttl, retention, purged
    execution_timeout_s: float
    ttl_s: float
    submitted_at: float
    states: list[LedgerState]
    worker_id: str | None
    deliveries: list[LedgerDelivery]
    billed_s: float
    retries: int
    late_posts: int  # job-done / stream posts that arrived after the job left the worker
    webhook_answers: list[str]


class LedgerWorker(BaseModel):
    id: str
    pid: int | None
    state: str
    started_at: float  # billing starts here (cold start included)
    cold_start_s: float
    ready_at: float | None  # its first job-take
    stop_requested_at: float | None  # billing ends here when the platform stopped it
    exited_at: float | None
    stop_reason: str | None  # idle, crash, exited, refresh, execution_timeout, shutdown, ...
    exit_code: int | None
    billed_s: float
    jobs: list[str]
    last_job_end_at: float | None
    billed_after_last_job_s: float | None
    pings: int
    last_ping_at: float | None
    last_ping_jobs: list[str]
    fitness_failures: list[dict[str, str]]
    env_keys: list[str]
    log: str


class LedgerTotals(BaseModel):
    worker_billed_s: float
    job_billed_s: float
    workers_alive: int  # initializing, idle or running
    workers_stopping: int  # told to stop, process not gone yet
    jobs_in_progress: int


class Ledger(BaseModel):
    simulator: str
    clock_speed: float
    now: float
    started_at_unix: float
    idle_timeout_s: float
    max_workers: int
    min_workers: int
    jobs: list[LedgerJob]
    workers: list[LedgerWorker]
    totals: LedgerTotals

    def job(self, job_id: str) -> LedgerJob:
        return next(j for j in self.jobs if j.id == job_id)

    def worker(self, worker_id: str) -> LedgerWorker:
        return next(w for w in self.workers if w.id == worker_id)

    def jobs_for(self, submission: str) -> list[LedgerJob]:
        return [j for j in self.jobs if j.submission == submission]


def _delivery(d: Delivery, now: float) -> LedgerDelivery:
    return LedgerDelivery(
        worker_id=d.worker_id,
        taken_at=round(d.taken_at, 3),
        ended_at=_r(d.ended_at),
        outcome=d.outcome,
        progress_updates=d.progress_updates,
        stream_chunks=d.stream_chunks,
        billed_s=round(d.billed_s(now), 3),
    )


def _job(job: Job, now: float) -> LedgerJob:
    return LedgerJob(
        id=job.id,
        submission=job.submission,
        sync=job.sync,
        status=job.status,
        gone=job.gone,
        execution_timeout_s=job.execution_timeout_s,
        ttl_s=job.ttl_s,
        submitted_at=round(job.submitted_at, 3),
        states=[LedgerState(status=s.status, at=round(s.at, 3), note=s.note) for s in job.states],
        worker_id=job.worker_id,
        deliveries=[_delivery(d, now) for d in job.deliveries],
        billed_s=round(sum(d.billed_s(now) for d in job.deliveries), 3),
        retries=job.retries,
        late_posts=job.late_posts,
        webhook_answers=list(job.webhook_answers),
    )


def _worker(worker: Worker, now: float) -> LedgerWorker:
    end = worker.billing_end()
    after_last = None
    if worker.last_job_end_at is not None:
        after_last = (end if end is not None else now) - worker.last_job_end_at
    return LedgerWorker(
        id=worker.id,
        pid=worker.pid,
        state=worker.state,
        started_at=round(worker.started_at, 3),
        cold_start_s=worker.cold_start_s,
        ready_at=_r(worker.ready_at),
        stop_requested_at=_r(worker.stop_requested_at),
        exited_at=_r(worker.exited_at),
        stop_reason=worker.stop_reason,
        exit_code=worker.exit_code,
        billed_s=round(worker.billed_s(now), 3),
        jobs=list(worker.job_history),
        last_job_end_at=_r(worker.last_job_end_at),
        billed_after_last_job_s=_r(after_last),
        pings=worker.pings,
        last_ping_at=_r(worker.last_ping_at),
        last_ping_jobs=list(worker.last_ping_jobs),
        fitness_failures=list(worker.fitness_failures),
        env_keys=list(worker.env_keys),
        log=str(worker.log_path),
    )


def build_ledger(
    settings: SimSettings, clock: SimClock, table: JobTable, pool: WorkerPool
) -> dict[str, Any]:
    now = clock.now()
    jobs = [_job(j, now) for j in table.jobs.values()]
    workers = [_worker(w, now) for w in pool.workers.values()]
    ledger = Ledger(
        simulator=SIM_VERSION,
        clock_speed=clock.speed,
        now=round(now, 3),
        started_at_unix=clock.started_at_unix,
        idle_timeout_s=settings.idle_timeout_s,
        max_workers=settings.max_workers,
        min_workers=settings.min_workers,
        jobs=jobs,
        workers=workers,
        totals=LedgerTotals(
            worker_billed_s=round(sum(w.billed_s for w in workers), 3),
            job_billed_s=round(sum(j.billed_s for j in jobs), 3),
            workers_alive=sum(1 for w in pool.workers.values() if w.alive),
            workers_stopping=sum(1 for w in pool.workers.values() if w.state == "stopping"),
            jobs_in_progress=len(table.in_progress()),
        ),
    )
    return ledger.model_dump(mode="json")
