"""Simulator-only fault injection (POST /sim/faults): make the platform misbehave on purpose, the
ways RunPod is known to. None of this is part of RunPod's API.

Every fault is a countdown taken by the next matching event, except the two worker states
(`unhealthy_workers`, `throttled_workers`), which hold until cleared; fields left out of a POST
keep their current value, `null`, 0 or `false` disarms. POST /sim/reset disarms everything (a
frozen or partitioned worker stays so until its own timer, or its end).

Three faults are armed on a job delivery: they are taken by the `on_delivery`-th delivery from
now (counting only deliveries to `worker_id` and of `job_id` when those are given: per worker,
per job) and fire `after_s` simulator seconds after the worker took the job or once
`after_progress` progress updates arrived, or once an update reported `after_artifacts` stored
outputs (our handler's updates list them), whichever comes first (none: 1 s); with `in_stage`,
only updates at that stage count towards the last two. A delivery that ends first takes its plan
with it. Each fired one is an event of its worker in the ledger
(`workers[].events`: kind, simulator time, job).

- `crash`: kill -9 the worker (its whole process group and its watchdog, as a container dying).
  The job then goes TIMED_OUT, is re-delivered to another worker, or stays IN_PROGRESS until its
  execution timeout (`outcome`).
- `freeze`: SIGSTOP the handler's process group (the handler and whatever it started in its
  group; not the worker's ComfyUI nor its watchdog, each in a session of its own): a hung
  handler. The platform keeps the job IN_PROGRESS and the worker billed, as RunPod does for a
  hung container. SIGCONT after `thaw_after_s` simulator seconds (event `thaw`), else frozen
  until the worker ends (its watchdog kills it, the execution timeout stops it). `outcome`:
  what its job becomes should the worker die meanwhile (default: --worker-death).
- `partition`: cut the worker (its handler and watchdog) off from S3 while its ComfyUI runs on:
  its S3 proxy (s3_proxy.py) resets every open and new connection; reopened after
  `heal_after_s` simulator seconds (event `heal`), else for as long as the worker lives. Only
  that worker loses S3. A worker without a proxy (no http BUCKET_ENDPOINT_URL) records
  `partition_skipped`.
- `burst_429` / `burst_5xx`: the next N public API requests (optionally only those of
  `burst_429_routes` / `burst_5xx_routes`) are answered 429 (with Retry-After) or
  `burst_5xx_status`, before authentication, as a gateway would. Each burst keeps its own routes:
  a 429 burst armed while a route-limited 5xx burst is still pending does not widen the latter.
- `drop_run_answer`: the next N `/run` requests create their job, then the connection is closed
  without an answer: the client cannot know the job exists.
- `slow_cold_start_s`: the next `slow_cold_starts` workers take that much longer to start.
- `lost_result`: the next N final job-done posts are refused with 400 and their job is COMPLETED
  without output (what users report after a result too big for RunPod).
- `unhealthy_workers`: while true, the endpoint's workers fail their health check: every live
  worker holding no job (booting or idle; one started meanwhile too) is `unhealthy` in
  `/health` (not initializing, idle nor ready), takes no job (they stay IN_QUEUE) and is no
  capacity to the autoscaler (which may start more, up to max workers: unhealthy too). A job
  already running on a worker runs on to its end (the worker counts as running meanwhile),
  then the worker is unhealthy. Workers are neither killed nor replaced for it; cleared, they
  are healthy again and take the queue.
- `throttled_workers`: while true, no GPU is free for a new worker: the autoscaler starts none,
  and `/health` counts as `throttled` the workers it would start (for queued jobs no idle or
  booting worker will take, and up to the active workers; at most max workers in all). Workers
  already launched, booting included, work on. Cleared, the autoscaler starts them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .jobs import DeliveryFaultKind, FaultPlan
from .settings import DeathOutcome

PublicRoute = Literal[
    "run", "runsync", "status", "stream", "cancel", "retry", "purge-queue", "health"
]


class DeliveryFault(BaseModel):
    """Which delivery a fault is armed on, and when in it it fires."""

    model_config = ConfigDict(extra="forbid")

    on_delivery: int = Field(default=1, ge=1)
    after_s: float | None = Field(default=None, ge=0)
    after_progress: int | None = Field(default=None, ge=1)
    after_artifacts: int | None = Field(default=None, ge=1)
    # Only progress updates at this stage (their `stage`) count towards the two above.
    in_stage: str | None = None
    # Only deliveries to this worker / of this job count (None: any).
    worker_id: str | None = None
    job_id: str | None = None

    def matches(self, worker_id: str, job_id: str) -> bool:
        return self.worker_id in (None, worker_id) and self.job_id in (None, job_id)


class CrashFault(DeliveryFault):
    outcome: DeathOutcome = "timed_out"


class FreezeFault(DeliveryFault):
    thaw_after_s: float | None = Field(default=None, gt=0)
    outcome: DeathOutcome | None = None


class PartitionFault(DeliveryFault):
    heal_after_s: float | None = Field(default=None, gt=0)
    outcome: DeathOutcome | None = None


class FaultConfig(BaseModel):
    """The body of POST /sim/faults."""

    model_config = ConfigDict(extra="forbid")

    crash: CrashFault | None = None
    freeze: FreezeFault | None = None
    partition: PartitionFault | None = None
    burst_429: int = Field(default=0, ge=0)
    burst_5xx: int = Field(default=0, ge=0)
    burst_5xx_status: int = Field(default=503, ge=500, le=599)
    burst_429_routes: list[PublicRoute] | None = None
    burst_5xx_routes: list[PublicRoute] | None = None
    drop_run_answer: int = Field(default=0, ge=0)
    slow_cold_start_s: float = Field(default=0.0, ge=0)
    slow_cold_starts: int = Field(default=1, ge=0)
    lost_result: int = Field(default=0, ge=0)
    # Worker states rather than countdowns: they hold until cleared.
    unhealthy_workers: bool = False
    throttled_workers: bool = False


DELIVERY_FAULTS: tuple[DeliveryFaultKind, ...] = ("crash", "freeze", "partition")


class FaultState:
    def __init__(self) -> None:
        self.armed = FaultConfig()
        # Per delivery fault: matching deliveries left until it is taken (None: not armed).
        self.deliveries_until: dict[DeliveryFaultKind, int | None] = dict.fromkeys(DELIVERY_FAULTS)
        # How often each fault fired, for GET /sim/faults.
        self.taken: dict[str, int] = {}

    def arm(self, update: FaultConfig) -> None:
        changes = update.model_dump(exclude_unset=True)
        self.armed = self.armed.model_copy(update={k: getattr(update, k) for k in changes})
        for kind in DELIVERY_FAULTS:
            if kind in changes:
                fault: DeliveryFault | None = getattr(self.armed, kind)
                self.deliveries_until[kind] = fault.on_delivery if fault else None

    def reset(self) -> None:
        self.armed = FaultConfig()
        self.deliveries_until = dict.fromkeys(DELIVERY_FAULTS)
        self.taken.clear()

    def _count(self, name: str) -> None:
        self.taken[name] = self.taken.get(name, 0) + 1

    def take_plans(self, now: float, worker_id: str, job_id: str) -> list[FaultPlan]:
        """Called at each job delivery: the fault plans for it, if it is the one."""
        plans = []
        for kind in DELIVERY_FAULTS:
            fault: DeliveryFault | None = getattr(self.armed, kind)
            left = self.deliveries_until[kind]
            if fault is None or left is None or not fault.matches(worker_id, job_id):
                continue
            self.deliveries_until[kind] = left - 1
            if left > 1:
                continue
            self.armed = self.armed.model_copy(update={kind: None})
            self.deliveries_until[kind] = None
            self._count(kind)
            plans.append(_plan(kind, fault, now))
        return plans

    def take_burst(self, route: str) -> int | None:
        """The status to answer instead of serving this public request, if a burst is on."""
        armed = self.armed
        if armed.burst_429 > 0 and _in(route, armed.burst_429_routes):
            self.armed = armed.model_copy(update={"burst_429": armed.burst_429 - 1})
            self._count("burst_429")
            return 429
        if armed.burst_5xx > 0 and _in(route, armed.burst_5xx_routes):
            self.armed = armed.model_copy(update={"burst_5xx": armed.burst_5xx - 1})
            self._count("burst_5xx")
            return armed.burst_5xx_status
        return None

    def _take(self, name: str) -> bool:
        left = getattr(self.armed, name)
        if left <= 0:
            return False
        self.armed = self.armed.model_copy(update={name: left - 1})
        self._count(name)
        return True

    def take_drop_run_answer(self) -> bool:
        return self._take("drop_run_answer")

    def take_lost_result(self) -> bool:
        return self._take("lost_result")

    def take_cold_start_extra(self) -> float:
        armed = self.armed
        if armed.slow_cold_start_s <= 0 or not self._take("slow_cold_starts"):
            return 0.0
        return armed.slow_cold_start_s

    def as_json(self) -> dict[str, Any]:
        return {
            **self.armed.model_dump(),
            **{f"deliveries_until_{k}": v for k, v in self.deliveries_until.items()},
            "taken": dict(self.taken),
        }


def _plan(kind: DeliveryFaultKind, fault: DeliveryFault, now: float) -> FaultPlan:
    after_s = fault.after_s
    if after_s is None and fault.after_progress is None and fault.after_artifacts is None:
        after_s = 1.0
    lasts_s: float | None = None
    outcome: DeathOutcome | None = None
    if isinstance(fault, CrashFault):
        outcome = fault.outcome
    elif isinstance(fault, FreezeFault):
        lasts_s, outcome = fault.thaw_after_s, fault.outcome
    elif isinstance(fault, PartitionFault):
        lasts_s, outcome = fault.heal_after_s, fault.outcome
    return FaultPlan(
        kind=kind,
        at=None if after_s is None else now + after_s,
        after_progress=fault.after_progress,
        after_artifacts=fault.after_artifacts,
        in_stage=fault.in_stage,
        outcome=outcome,
        lasts_s=lasts_s,
    )


def _in(route: str, routes: list[PublicRoute] | None) -> bool:
    return routes is None or route in routes
