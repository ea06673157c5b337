"""Submits the job mix at the asked rate, cancels the planned ones mid-run, and at the end waits
(bounded) for every job to end.

Every call to Temporal may meet the dev server down (a fault): each is retried patiently, never
counted against the system. A job is started detached under its own ID, so a retried start after
a lost answer finds the same job (`existed`) instead of starting another.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog
from temporalio.client import WorkflowExecutionStatus

from faults.soak.mix import JobMix, JobPlan
from starter import JobClient
from starter.errors import JobAlreadyEnded, JobConflict
from workflows.contracts import JobState, JobStatus

log = structlog.get_logger("soak.jobs")

T = TypeVar("T")
CALL_TIMEOUT_S = 15.0
SUBMIT_BUDGET_S = 180.0
# How long a planned cancel waits for its job to be seen running.
RUNNING_BUDGET_S = 600.0
CANCEL_BUDGET_S = 120.0
POLL_S = 1.0
DRAIN_POLL_S = 2.0


@dataclass
class JobRecord:
    plan: JobPlan
    submitted_at: float
    started: bool = False
    submit_error: str | None = None
    cancel_sent_at: float | None = None
    final: JobStatus | None = None
    last: JobStatus | None = None
    ended_at: float | None = None
    # Seen waiting in NEEDS_DECISION at the drain: it will not end by itself.
    waiting_for_decision: bool = False

    @property
    def job_id(self) -> str:
        return self.plan.job_id


async def patiently(call: Callable[[], Awaitable[T]], budget_s: float, what: str) -> T:
    """`call()` until it answers, each try bounded, for at most `budget_s` (then the last
    error is raised)."""
    deadline = time.monotonic() + budget_s
    delay = 0.5
    while True:
        try:
            return await asyncio.wait_for(call(), CALL_TIMEOUT_S)
        except (JobAlreadyEnded, JobConflict):
            raise
        except Exception as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.debug("retrying", what=what, error=f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 5.0)


class JobDriver:
    def __init__(
        self, client: JobClient, mix: JobMix, rng: random.Random, jobs_per_minute: float
    ) -> None:
        self.client = client
        self.mix = mix
        self.rng = rng
        self.interval_s = 60.0 / jobs_per_minute
        self.records: list[JobRecord] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, until: float) -> None:
        """Submit until `until` (epoch seconds), one job every interval (jittered +-50%)."""
        while time.time() < until:
            record = JobRecord(self.mix.next(), submitted_at=time.time())
            self.records.append(record)
            task = asyncio.create_task(self._life(record), name=f"soak {record.job_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            pause = self.interval_s * self.rng.uniform(0.5, 1.5)
            await asyncio.sleep(max(0.0, min(pause, until - time.time())))

    async def _life(self, record: JobRecord) -> None:
        plan = record.plan
        try:
            await patiently(
                lambda: self.client.start(plan.request, job_id=plan.job_id, detached=True),
                SUBMIT_BUDGET_S,
                f"start {plan.job_id}",
            )
        except Exception as exc:
            record.submit_error = f"{type(exc).__name__}: {exc}"
            log.error("job_not_started", job_id=plan.job_id, error=record.submit_error)
            return
        record.started = True
        log.info(
            "job_started",
            job_id=plan.job_id,
            pool=plan.pool.name,
            kind=plan.kind,
            steps=plan.steps,
            cancel_after_s=plan.cancel_after_s,
        )
        if plan.cancel_after_s is not None:
            await self._cancel_later(record, plan.cancel_after_s)

    async def _cancel_later(self, record: JobRecord, after_s: float) -> None:
        deadline = time.monotonic() + RUNNING_BUDGET_S
        while time.monotonic() < deadline:
            try:
                status = await asyncio.wait_for(self.client.status(record.job_id), CALL_TIMEOUT_S)
            except Exception:
                await asyncio.sleep(POLL_S)
                continue
            record.last = status
            if status.terminal:
                return
            if status.state in (JobState.RUNNING, JobState.RECONNECTING):
                break
            await asyncio.sleep(POLL_S)
        else:
            return
        await asyncio.sleep(after_s)
        try:
            await patiently(
                lambda: self.client.cancel(record.job_id, reason="soak: cancelled mid-run"),
                CANCEL_BUDGET_S,
                f"cancel {record.job_id}",
            )
        except JobAlreadyEnded:
            return
        except Exception as exc:
            log.error("cancel_not_sent", job_id=record.job_id, error=str(exc))
            return
        record.cancel_sent_at = time.time()
        log.info("cancel_sent", job_id=record.job_id)

    async def drain(self, timeout_s: float) -> None:
        """Wait until every started job has ended (or waits for a decision), at most
        `timeout_s`; then stop the driver's own tasks (planned cancels not sent by then)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pending = [
                r
                for r in self.records
                if r.started and r.final is None and not r.waiting_for_decision
            ]
            # A job whose start is still being retried has not been counted yet.
            starting = [r for r in self.records if not r.started and r.submit_error is None]
            if not pending and not starting:
                break
            for record in pending:
                await self._probe(record)
            await asyncio.sleep(DRAIN_POLL_S)
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _probe(self, record: JobRecord) -> None:
        handle = self.client.handle(record.job_id)
        try:
            description = await asyncio.wait_for(handle.describe(), CALL_TIMEOUT_S)
        except Exception:
            return
        if description.status == WorkflowExecutionStatus.RUNNING:
            try:
                status = await asyncio.wait_for(self.client.status(record.job_id), CALL_TIMEOUT_S)
            except Exception:
                return
            record.last = status
            record.waiting_for_decision = status.state == JobState.NEEDS_DECISION
            return
        try:
            final = await patiently(
                lambda: self.client.wait(record.job_id), 60.0, f"wait {record.job_id}"
            )
        except Exception as exc:
            log.error("final_status_unread", job_id=record.job_id, error=str(exc))
            return
        record.final = record.last = final
        close = description.close_time
        record.ended_at = close.timestamp() if close is not None else time.time()
        log.info("job_ended", job_id=record.job_id, state=final.state.value)
