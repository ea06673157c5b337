"""Tenants' daily GPU budgets: what a tenant's ledger keeps (workflows/budget_ledger.py), the
arithmetic of a budget day, and a job's side (its hold until the reset, its spend at its end).

A tenant's budget (`gpu_seconds_per_day` and/or `usd_per_day`, configuration/tenants.py) is
spent by its jobs' GPU time: on a `runpod` pool what RunPod billed as their execution, on a
`comfyui` pool their prompts' execution as the follow measured it. Days are counted from the
Unix epoch in steps of `day_s` (the workers' `DURABLE_COMFY_BUDGET_DAY_S`, 86,400 by default, so
a day begins at 00:00 UTC). A job is checked before it may start (activities/backend.py): when
its tenant's spend today has reached a limit, it waits `PENDING` with `admission.held` =
`budget` until the reset, then is checked again. It tells its tenant's ledger what it spent
once it has ended, so a running job is never stopped by a budget, and a day's spend may pass
its limit by what the jobs running at the moment it was reached spend.

Pure and deterministic (every time is given), so the ledger replays it and tests drive it.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import shared
    from workflows.admission import clock
    from workflows.contracts import JobStatus

DEFAULT_BUDGET_DAY_S: Final = 86400.0
EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
# The job IDs a ledger remembers as counted (today's, then yesterday's): a job tells its ledger
# once, from its workflow's end, so a repeat is rare; the most recent this many are kept, so
# the ledger's carry stays far below Temporal's 2 MiB payload however many jobs a day runs.
MAX_COUNTED: Final = 10_000
# A job held until the reset checks again within this share of a day after it (at most
# RESET_JITTER_MAX_S): the jobs held at a reset do not all ask their ledger at once.
RESET_JITTER_SHARE: Final = 0.05
RESET_JITTER_MAX_S: Final = 30.0


class _Read(BaseModel):
    # What one version writes and another reads (a job of an old version tells a ledger on a
    # new one): a field it does not know is ignored.
    model_config = ConfigDict(extra="ignore")


def day_of(now: datetime, day_s: float) -> tuple[datetime, datetime]:
    """The budget day `now` falls in, [start, end): days counted from the Unix epoch in steps of
    `day_s`, so 86,400 s days begin at 00:00 UTC."""
    index = math.floor((now - EPOCH).total_seconds() / day_s)
    start = EPOCH + timedelta(seconds=index * day_s)
    end = start + timedelta(seconds=day_s)
    if end <= now:  # float rounding at a boundary: `now` begins the next day
        start, end = end, end + timedelta(seconds=day_s)
    return start, end


class BudgetLimits(_Read):
    """A tenant's budget as the workers' settings say it (the ledger keeps the latest it was
    told)."""

    tenant: str
    gpu_seconds_per_day: float | None = None
    usd_per_day: float | None = None
    over_budget: Literal["wait", "refuse"] | str = "wait"
    day_s: float = DEFAULT_BUDGET_DAY_S


class Spent(_Read):
    """A job's spend, told to its tenant's ledger once the job has ended (signal `spent`)."""

    job_id: str
    gpu_s: float = 0.0
    usd: float | None = None
    at: datetime | None = None


def over_limit(gpu_s: float, usd: float, limits: BudgetLimits) -> str | None:
    """Why a tenant that spent `gpu_s` and `usd` today may start nothing more (None: it may)."""
    reasons = []
    if limits.gpu_seconds_per_day is not None and gpu_s >= limits.gpu_seconds_per_day:
        reasons.append(f"{gpu_s:.1f} of its {limits.gpu_seconds_per_day:g} GPU-seconds")
    if limits.usd_per_day is not None and usd >= limits.usd_per_day:
        reasons.append(f"${usd:.4f} of its ${limits.usd_per_day:g}")
    if not reasons:
        return None
    return f"tenant {limits.tenant!r} has spent {' and '.join(reasons)} today"


class BudgetUsage(_Read):
    """A tenant's spend today, as its ledger has it (query `usage`): what `durable-comfy
    tenants`, `GET /v1/usage` and the checks read."""

    tenant: str
    gpu_s: float = 0.0
    usd: float = 0.0
    # Jobs whose spend was counted today.
    jobs: int = 0
    gpu_seconds_per_day: float | None = None
    usd_per_day: float | None = None
    over_budget: Literal["wait", "refuse"] | str = "wait"
    day_s: float = DEFAULT_BUDGET_DAY_S
    day_started_at: datetime | None = None
    resets_at: datetime | None = None
    # The spend has reached a limit: a new job waits (or is refused) until `resets_at`.
    over: bool = False
    reason: str = ""
    as_of: datetime | None = None

    def over_at(self, now: datetime) -> bool:
        """Over budget at `now` (a reading taken before the reset says nothing after it)."""
        return self.over and (self.resets_at is None or now < self.resets_at)


class BudgetHold(_Read):
    """A check's word that the job may not start before its tenant's budget resets."""

    tenant: str
    # The pool the job was checked on (what its `admission` names while it is held).
    pool: str
    resets_at: datetime
    reason: str = ""
    day_s: float = DEFAULT_BUDGET_DAY_S

    def recheck_in_s(self, now: datetime, draw: float) -> float:
        """Seconds until the job checks again: the reset, plus a jitter from `draw` in [0, 1)."""
        jitter = min(self.day_s * RESET_JITTER_SHARE, RESET_JITTER_MAX_S) * draw
        return max((self.resets_at - now).total_seconds(), 0.0) + jitter + 0.001


class LedgerState(_Read):
    """Everything a ledger carries into its next run (continue-as-new)."""

    limits: BudgetLimits
    day_started_at: datetime | None = None
    gpu_s: float = 0.0
    usd: float = 0.0
    jobs: int = 0
    counted: list[str] = Field(default_factory=list)
    counted_before: list[str] = Field(default_factory=list)
    # The ledger continues as new past this many events (its history stays quick to replay).
    history_limit: int = 2000


class BudgetDay:
    """One tenant's spend for the current budget day: limits in, spends in, usage out."""

    def __init__(self, state: LedgerState, now: datetime) -> None:
        self.state = state
        self._counted = set(state.counted)
        self._before = set(state.counted_before)
        start, _end = day_of(now, state.limits.day_s)
        if state.day_started_at is None:
            state.day_started_at = start
        self.roll(now)

    @property
    def resets_at(self) -> datetime:
        started = self.state.day_started_at
        assert started is not None
        return started + timedelta(seconds=self.state.limits.day_s)

    def roll(self, now: datetime) -> bool:
        """A new day when `now` is past the reset: spend back to nothing. True when it was."""
        if now < self.resets_at:
            return False
        state = self.state
        state.day_started_at, _end = day_of(now, state.limits.day_s)
        state.counted_before, state.counted = state.counted[-MAX_COUNTED:], []
        self._before, self._counted = set(state.counted_before), set()
        state.gpu_s, state.usd, state.jobs = 0.0, 0.0, 0
        return True

    def told(self, limits: BudgetLimits, now: datetime) -> bool:
        """The limits a worker has: kept (the latest wins). A new day length starts the day
        `now` falls in under it, today's spend kept. True when anything changed."""
        state = self.state
        if limits == state.limits:
            return False
        day_changed = limits.day_s != state.limits.day_s
        state.limits = limits
        if day_changed:
            state.day_started_at, _end = day_of(now, limits.day_s)
        return True

    def spend(self, spent: Spent) -> bool:
        """A job's spend, counted once (False: already counted, today or the day before). It
        counts on the day the ledger hears it."""
        if spent.job_id in self._counted or spent.job_id in self._before:
            return False
        state = self.state
        self._counted.add(spent.job_id)
        state.counted.append(spent.job_id)
        if len(state.counted) > MAX_COUNTED:
            self._counted.discard(state.counted.pop(0))
        state.gpu_s = round(state.gpu_s + max(spent.gpu_s, 0.0), 3)
        state.usd = round(state.usd + max(spent.usd or 0.0, 0.0), 6)
        state.jobs += 1
        return True

    def usage(self, now: datetime) -> BudgetUsage:
        state, limits = self.state, self.state.limits
        reason = over_limit(state.gpu_s, state.usd, limits)
        return BudgetUsage(
            tenant=limits.tenant,
            gpu_s=state.gpu_s,
            usd=state.usd,
            jobs=state.jobs,
            gpu_seconds_per_day=limits.gpu_seconds_per_day,
            usd_per_day=limits.usd_per_day,
            over_budget=limits.over_budget,
            day_s=limits.day_s,
            day_started_at=state.day_started_at,
            resets_at=self.resets_at,
            over=reason is not None,
            reason=reason or "",
            as_of=now,
        )


def hold_of(
    usage: BudgetUsage, limits: BudgetLimits, now: datetime, pool: str
) -> BudgetHold | None:
    """Whether a job of the tenant may start at `now`, judged by `limits` (the checking
    worker's) against the ledger's spend: a hold until the reset when a limit is reached."""
    if usage.resets_at is None or now >= usage.resets_at:
        return None  # the reading is of a day that is over: nothing spent yet today
    reason = over_limit(usage.gpu_s, usage.usd, limits)
    if reason is None:
        return None
    return BudgetHold(
        tenant=limits.tenant,
        pool=pool,
        resets_at=usage.resets_at,
        reason=f"{reason}; its budget resets at {clock(usage.resets_at)}",
        day_s=limits.day_s,
    )


def spend_of(status: JobStatus) -> Spent:
    """What a job spent, as it tells its ledger: its GPU-seconds (`JobStatus.gpu_s`) and their
    price where its pool gives one."""
    return Spent(job_id=status.job_id, gpu_s=status.gpu_s, usd=status.usd, at=workflow.now())


async def tell_ledger(tenant: str | None, status: JobStatus) -> None:
    """The job's spend, to its tenant's ledger, once it has ended (`tenant` None: its check
    found no budget, and its history has no such signal). A ledger that is gone (terminated)
    is started again by an activity, with the spend."""
    if tenant is None:
        return
    spent = spend_of(status)
    if spent.gpu_s <= 0 and not spent.usd:
        return  # nothing to count (a job that never ran)
    try:
        await workflow.get_external_workflow_handle(shared.ledger_id(tenant)).signal(
            shared.SIGNAL_LEDGER_SPENT, spent
        )
        return
    except Exception:
        workflow.logger.warning("ledger_not_told", extra={"tenant": tenant})
    await workflow.execute_activity(
        shared.ACTIVITY_RECORD_SPEND,
        args=[tenant, spent],
        start_to_close_timeout=timedelta(seconds=30),
        summary=f"tell the budget ledger of tenant {tenant}",
    )
