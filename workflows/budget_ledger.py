"""`TenantLedger`: one tenant's spend today, the one figure every worker and client reads.

A worker's check starts it (signal-with-start of `limits`, activities/budgets.py) the first
time a job of a tenant with a budget is checked, and tells it the tenant's limits again when
its own settings differ from the ledger's; every budgeted job tells it its spend once it has
ended (`spent`, counted once per job); every check, `durable-comfy tenants`, `GET /v1/usage`
and a client refusing a job over budget read it (the query `usage`: no history event).

Why a workflow: Temporal's history is durable and ordered, so a spend is counted once, however
many workers and gateway replicas there are and whichever of them is killed; a query gives every
reader the same figure at once. Not the bucket: a shared counter there needs leases or
compare-and-swap, a second source of truth beside Temporal to recover after a crash. Not the
visibility store: it is eventually consistent, and cannot sum a tenant's jobs' spend for a day.

It continues as new at each reset (the new run's day starts with nothing spent, and remembers
yesterday's counted jobs, so a late repeat is not counted again), past `history_limit` events,
and when a new worker version becomes current (like the pools' queues, onto that version).
It sets gauges of the tenant's spend on the worker that runs it (`durable_comfy_budget_*`).
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import shared
    from workflows.budgets import BudgetDay, BudgetLimits, BudgetUsage, LedgerState, Spent


class LedgerMetrics:
    """The tenant's spend today as gauges, on the SDK's workflow meter (silent while
    replaying); set by the worker that last ran the ledger, so a dashboard takes their `max by
    (tenant)`."""

    def __init__(self) -> None:
        meter = workflow.metric_meter()
        self._gpu = meter.create_gauge_float(
            "durable_comfy_budget_gpu_seconds", "GPU-seconds a tenant's jobs spent today", "s"
        )
        self._usd = meter.create_gauge_float(
            "durable_comfy_budget_usd", "Dollars a tenant's jobs spent today"
        )
        self._limit = meter.create_gauge_float(
            "durable_comfy_budget_gpu_seconds_limit", "A tenant's GPU-seconds per day", "s"
        )
        self._over = meter.create_gauge(
            "durable_comfy_budget_over", "1 while a tenant's spend today has reached its budget"
        )

    def show(self, usage: BudgetUsage) -> None:
        labels = {"tenant": usage.tenant}
        self._gpu.set(usage.gpu_s, labels)
        self._usd.set(usage.usd, labels)
        if usage.gpu_seconds_per_day is not None:
            self._limit.set(usage.gpu_seconds_per_day, labels)
        self._over.set(1 if usage.over else 0, labels)


@workflow.defn(name=shared.LEDGER_WORKFLOW_TYPE)
class TenantLedger:
    @workflow.init
    def __init__(self, state: LedgerState) -> None:
        self._day = BudgetDay(state, workflow.now())
        self._metrics = LedgerMetrics()
        self._news = True
        self._reset_due = False

    @workflow.run
    async def run(self, state: LedgerState) -> None:
        timer_for = self._day.resets_at
        reset = asyncio.create_task(self._reset_at(timer_for))
        while True:
            await workflow.wait_condition(
                lambda: self._news or self._reset_due or self._should_continue()
            )
            self._news = False
            self._metrics.show(self._day.usage(workflow.now()))
            if self._reset_due or self._should_continue():
                break
            if self._day.resets_at != timer_for:
                # A new day length: the day ends at another time.
                reset.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reset
                timer_for = self._day.resets_at
                reset = asyncio.create_task(self._reset_at(timer_for))
        reset.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reset
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._day.roll(workflow.now()):
            self._metrics.show(self._day.usage(workflow.now()))
        workflow.continue_as_new(
            self._day.state,
            initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
        )

    async def _reset_at(self, at: datetime) -> None:
        """One timer per day (not one per wait of the loop, which every signal would cancel)."""
        left = (at - workflow.now()).total_seconds()
        if left > 0:
            await workflow.sleep(timedelta(seconds=left), summary="budget day resets")
        self._reset_due = True

    def _roll(self) -> None:
        """A message heard at or past the reset begins the new day (the run then continues as
        new, as at the timer)."""
        if self._day.roll(workflow.now()):
            self._reset_due = True

    def _should_continue(self) -> bool:
        info = workflow.info()
        if info.is_continue_as_new_suggested():
            return True
        if info.get_current_history_length() > self._day.state.history_limit:
            return True
        return info.is_target_worker_deployment_version_changed()

    # -- messages: tolerant, so no payload can fail a workflow task ---------------------------

    @workflow.signal(name=shared.SIGNAL_LEDGER_LIMITS)
    def limits(self, payload: Any = None) -> None:
        """The tenant's limits as a worker's settings say them (the latest wins)."""
        try:
            limits = BudgetLimits.model_validate(payload)
        except ValueError:
            return
        if limits.tenant != self._day.state.limits.tenant or limits.day_s <= 0:
            return
        self._roll()  # heard after the reset: of the new day
        if self._day.told(limits, workflow.now()):
            self._news = True

    @workflow.signal(name=shared.SIGNAL_LEDGER_SPENT)
    def spent(self, payload: Any = None) -> None:
        """A job's spend, once it has ended (counted once per job)."""
        try:
            spent = Spent.model_validate(payload)
        except ValueError:
            return
        # Heard at or after the reset (its timer not fired yet): counted in the new day.
        self._roll()
        if self._day.spend(spent):
            self._news = True

    @workflow.query(name=shared.QUERY_LEDGER_USAGE)
    def usage(self, _ignored: Any = None) -> BudgetUsage:
        return self._day.usage(workflow.now())
