"""GET /sim/ledger: the simulator's bill. Every job (its submission token, every state with its
time, the worker of each delivery, billed seconds) and every worker (started, stopped, billed
seconds, why it stopped, its ComfyUI, its watchdog, and the faults done to it as events: when it
was frozen and thawed, cut off from S3 and healed, crashed), so tests can prove nothing ran
twice, nothing was paid for twice and nothing was left running.

All times are simulator seconds since the simulator started (`now` is the current one); billed
seconds are simulator seconds too. These models are the ledger's schema: tests read it back with
`Ledger.model_validate(...)`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

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


class LedgerWorkerEvent(BaseModel):
    """A fault done to the worker (crash, freeze, thaw, partition, heal, partition_skipped) or
    its watchdog's end (watchdog_exited, watchdog_failed), at a simulator time."""

    kind: str
    at: float
    job_id: str | None = None
    detail: str = ""


class LedgerWorker(BaseModel):
    id: str
    pid: int | None
    state: str
    started_at: float  # billing starts here (cold start included)
    cold_start_s: float
    ready_at: float | None  # its first job-take
    stop_requested_at: float | None  # billing ends here when the platform stopped it
    exited_at: float | None
    # idle, crash, watchdog (killed by its watchdog), exited, refresh, execution_timeout,
    # shutdown, start_failed
    stop_reason: str | None
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
    # Its ComfyUI (from the env factories), for tests that count executions across workers.
    comfy_url: str | None = None
    comfy_pid: int | None = None
    # Its watchdog: off, running, exited (by itself, while the worker lived), stopped (with it).
    watchdog: str = "off"
    watchdog_pid: int | None = None
    watchdog_exit_code: int | None = None
    watchdog_log: str | None = None
    fence_file: str | None = None
    # The BUCKET_ENDPOINT_URL it was given: its own S3 proxy's when it has one.
    s3_url: str | None = None
    s3_proxied: bool = False
    frozen: bool = False  # now (a freeze fault not thawed yet)
    partitioned: bool = False  # now (a partition fault not healed yet)
    events: list[LedgerWorkerEvent] = Field(default_factory=list)

    def events_of(self, kind: str) -> list[LedgerWorkerEvent]:
        return [e for e in self.events if e.kind == kind]


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
    # Public API calls by route (run, status, cancel, ...) that passed the key and endpoint
    # checks, refused by the rate limit or not: what a client spends of RunPod's limits.
    api_calls: dict[str, int] = Field(default_factory=dict)

    def job(self, job_id: str) -> LedgerJob:
        return next(j for j in self.jobs if j.id == job_id)

    def worker(self, worker_id: str) -> LedgerWorker:
        return next(w for w in self.workers if w.id == worker_id)

    def jobs_for(self, submission: str) -> list[LedgerJob]:
        return [j for j in self.jobs if j.submission == submission]

    def epoch(self, at: float) -> float:
        """A simulator time as epoch seconds."""
        return self.started_at_unix + at / self.clock_speed


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
    watchdog = worker.watchdog
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
        comfy_url=worker.comfy_url,
        comfy_pid=worker.comfy_pid,
        watchdog=watchdog.state if watchdog is not None else "off",
        watchdog_pid=watchdog.pid if watchdog is not None else None,
        watchdog_exit_code=watchdog.exit_code if watchdog is not None else None,
        watchdog_log=str(watchdog.log_path) if watchdog is not None else None,
        fence_file=str(watchdog.fence_file) if watchdog is not None else None,
        s3_url=worker.s3_url,
        s3_proxied=worker.s3_proxy is not None,
        frozen=worker.frozen,
        partitioned=worker.partitioned,
        events=[
            LedgerWorkerEvent(kind=e.kind, at=round(e.at, 3), job_id=e.job_id, detail=e.detail)
            for e in worker.events
        ],
    )


def build_ledger(
    settings: SimSettings,
    clock: SimClock,
    table: JobTable,
    pool: WorkerPool,
    api_calls: dict[str, int] | None = None,
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
        api_calls=dict(api_calls or {}),
    )
    return ledger.model_dump(mode="json")
