"""Simulator-only fault injection (POST /sim/faults): make the platform misbehave on purpose, the
ways RunPod is known to. None of this is part of RunPod's API.

Every fault is a countdown taken by the next matching event; fields left out of a POST keep their
current value, `null` or 0 disarms. POST /sim/reset disarms everything.

- `crash`: kill -9 the worker (its whole process group, as a container dying) during its
  `on_delivery`-th job delivery from now, `after_s` simulator seconds after it took the job or once
  `after_progress` progress updates arrived. The job then goes TIMED_OUT, is re-delivered to
  another worker, or stays IN_PROGRESS until its execution timeout (`outcome`).
- `burst_429` / `burst_5xx`: the next N public API requests (optionally only those of
  `burst_429_routes` / `burst_5xx_routes`) are answered 429 (with Retry-After) or
  `burst_5xx_status`, before authentication, as a gateway would. Each burst keeps its own routes:
  a 429 burst armed while a route-limited 5xx burst is still pending does not widen the latter.
- `drop_run_answer`: the next N `/run` requests create their job, then the connection is closed
  without an answer: the client cannot know the job exists.
- `slow_cold_start_s`: the next `slow_cold_starts` workers take that much longer to start.
- `lost_result`: the next N final job-done posts are refused with 400 and their job is COMPLETED
  without output (what users report after a result too big for RunPod).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .jobs import CrashPlan
from .settings import DeathOutcome

PublicRoute = Literal[
    "run", "runsync", "status", "stream", "cancel", "retry", "purge-queue", "health"
]


class CrashFault(BaseModel):
    model_config = ConfigDict(extra="forbid")

    on_delivery: int = Field(default=1, ge=1)
    after_s: float | None = Field(default=None, ge=0)
    after_progress: int | None = Field(default=None, ge=1)
    outcome: DeathOutcome = "timed_out"


class FaultConfig(BaseModel):
    """The body of POST /sim/faults."""

    model_config = ConfigDict(extra="forbid")

    crash: CrashFault | None = None
    burst_429: int = Field(default=0, ge=0)
    burst_5xx: int = Field(default=0, ge=0)
    burst_5xx_status: int = Field(default=503, ge=500, le=599)
    burst_429_routes: list[PublicRoute] | None = None
    burst_5xx_routes: list[PublicRoute] | None = None
    drop_run_answer: int = Field(default=0, ge=0)
    slow_cold_start_s: float = Field(default=0.0, ge=0)
    slow_cold_starts: int = Field(default=1, ge=0)
    lost_result: int = Field(default=0, ge=0)


class FaultState:
    def __init__(self) -> None:
        self.armed = FaultConfig()
        self.deliveries_until_crash: int | None = None
        # How often each fault fired, for GET /sim/faults.
        self.taken: dict[str, int] = {}

    def arm(self, update: FaultConfig) -> None:
        changes = update.model_dump(exclude_unset=True)
        self.armed = self.armed.model_copy(update={k: getattr(update, k) for k in changes})
        if "crash" in changes:
            crash = self.armed.crash
            self.deliveries_until_crash = crash.on_delivery if crash else None

    def reset(self) -> None:
        self.armed = FaultConfig()
        self.deliveries_until_crash = None
        self.taken.clear()

    def _count(self, name: str) -> None:
        self.taken[name] = self.taken.get(name, 0) + 1

    def take_crash(self, now: float) -> CrashPlan | None:
        """Called at each job delivery: the crash plan for it, if this is the one."""
        crash = self.armed.crash
        if crash is None or self.deliveries_until_crash is None:
            return None
        self.deliveries_until_crash -= 1
        if self.deliveries_until_crash > 0:
            return None
        self.armed = self.armed.model_copy(update={"crash": None})
        self.deliveries_until_crash = None
        self._count("crash")
        after_s = crash.after_s
        if after_s is None and crash.after_progress is None:
            after_s = 1.0
        return CrashPlan(
            outcome=crash.outcome,
            at=None if after_s is None else now + after_s,
            after_progress=crash.after_progress,
        )

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
            "deliveries_until_crash": self.deliveries_until_crash,
            "taken": dict(self.taken),
        }


def _in(route: str, routes: list[PublicRoute] | None) -> bool:
    return routes is None or route in routes
