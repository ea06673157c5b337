"""The worker's side of tenants' daily budgets (workflows/budget_ledger.py): a job's check reads
its tenant's ledger, starting it with the tenant's limits the first time, and a job whose ledger
is gone records its spend by starting it again.

Only a tenant with a budget in the worker's `tenants` settings has a ledger: a job of any other
tenant asks nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import structlog
from temporalio import activity
from temporalio.client import Client, RPCTimeoutOrCancelledError, WorkflowQueryFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import retryable
from configuration.tenants import TenantConfig, budget_limits
from workflows.budgets import BudgetHold, BudgetLimits, BudgetUsage, LedgerState, Spent, hold_of
from workflows.shared import (
    ACTIVITY_RECORD_SPEND,
    LEDGER_WORKFLOW_TYPE,
    QUERY_LEDGER_USAGE,
    SIGNAL_LEDGER_LIMITS,
    SIGNAL_LEDGER_SPENT,
    ErrorType,
    ledger_id,
)

log = structlog.get_logger(__name__)

# How many times a check asks a ledger whose worker did not answer (0.2 s apart, then twice as
# long each time: about 3 s) before the check fails retryably: a budget is never passed over
# because its ledger could not be read, the job tries again after its backoff.
USAGE_ATTEMPTS = 5
# How long one read waits for the ledger's worker to answer: well inside the heartbeat timeout
# of a follow that checks (it heartbeats only once it follows).
USAGE_TIMEOUT = timedelta(seconds=5)
# A ledger too busy for another query now, a server in trouble, or a run that has not finished
# its first workflow task (just continued as new at the reset).
_TRY_AGAIN = (
    RPCStatusCode.RESOURCE_EXHAUSTED,
    RPCStatusCode.UNAVAILABLE,
    RPCStatusCode.FAILED_PRECONDITION,
)


def _same_terms(usage: BudgetUsage, limits: BudgetLimits) -> bool:
    return (
        usage.gpu_seconds_per_day == limits.gpu_seconds_per_day
        and usage.usd_per_day == limits.usd_per_day
        and usage.over_budget == limits.over_budget
        and usage.day_s == limits.day_s
    )


class BudgetActivities:
    def __init__(self, client: Client, tenants: Mapping[str, TenantConfig], day_s: float) -> None:
        self._client = client
        self._tenants = tenants
        self._day_s = day_s

    async def check(
        self, tenant: str, job_id: str, pool: str
    ) -> tuple[str | None, BudgetHold | None]:
        """For a job's check (activities/backend.py): the tenant whose ledger counts the job
        (None: it has no budget) and, when its spend today has reached a limit, the hold until
        the reset."""
        limits = budget_limits(self._tenants, tenant, self._day_s)
        if limits is None:
            return None, None
        task_queue = activity.info().task_queue
        usage = await self._usage(tenant)
        if usage is None or not _same_terms(usage, limits):
            # Its first job, or the workers' settings changed: the ledger keeps these.
            await self._signal_with_start(task_queue, limits, SIGNAL_LEDGER_LIMITS, limits)
        if usage is None:
            return tenant, None
        hold = hold_of(usage, limits, datetime.now(UTC), pool)
        if hold is not None:
            log.info("budget_held", job_id=job_id, tenant=tenant, resets_at=str(hold.resets_at))
        return tenant, hold

    async def _usage(self, tenant: str) -> BudgetUsage | None:
        """The ledger's reading; None when the tenant has no ledger yet."""
        handle = self._client.get_workflow_handle(ledger_id(tenant))
        why = "no answer"
        for attempt in range(USAGE_ATTEMPTS):
            try:
                usage: BudgetUsage = await handle.query(
                    QUERY_LEDGER_USAGE, result_type=BudgetUsage, rpc_timeout=USAGE_TIMEOUT
                )
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    return None
                if exc.status == RPCStatusCode.DEADLINE_EXCEEDED:
                    why = "no answer in time: is a worker running on its task queue?"
                    break
                if exc.status not in _TRY_AGAIN:
                    raise
                why = exc.message
            except RPCTimeoutOrCancelledError:
                why = "no answer in time: is a worker running on its task queue?"
                break
            except WorkflowQueryFailedError as exc:
                why = str(exc)
            else:
                return usage
            if attempt + 1 < USAGE_ATTEMPTS:
                await asyncio.sleep(0.2 * 2**attempt)
        raise retryable(
            ErrorType.BUDGET_UNKNOWN,
            f"the budget ledger of tenant {tenant!r} did not answer ({why}): checked again soon",
        )

    async def _signal_with_start(
        self, task_queue: str, limits: BudgetLimits, signal: str, message: object
    ) -> None:
        await self._client.start_workflow(
            LEDGER_WORKFLOW_TYPE,
            LedgerState(limits=limits),
            id=ledger_id(limits.tenant),
            task_queue=task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=signal,
            start_signal_args=[message],
        )

    @activity.defn(name=ACTIVITY_RECORD_SPEND)
    async def record_spend(self, tenant: str, spent: Spent) -> None:
        """A job's spend, its ledger started first when it does not run (terminated by an
        operator): signal-with-start."""
        limits = budget_limits(self._tenants, tenant, self._day_s) or BudgetLimits(
            tenant=tenant, day_s=self._day_s
        )
        await self._signal_with_start(
            activity.info().task_queue, limits, SIGNAL_LEDGER_SPENT, spent
        )
        log.info("budget_ledger_opened", tenant=tenant, job_id=spent.job_id)
