"""Tenants' daily budgets from a client's side (workflows/budget_ledger.py): reading a tenant's
ledger, listing every ledger (`durable-comfy tenants`), and refusing a new job while its
tenant's budget is spent and its settings say `over_budget: refuse` (`BudgetExceeded`).

A client needs no tenant settings for this: the ledger keeps the limits and the mode the
workers last told it. A tenant without a ledger has no budget (or no job of it was ever
checked), and nothing is refused.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from temporalio.client import (
    Client,
    RPCTimeoutOrCancelledError,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from starter.errors import BudgetExceeded
from workflows.budgets import BudgetUsage
from workflows.shared import LEDGER_WORKFLOW_TYPE, QUERY_LEDGER_USAGE, ledger_id

# How long a client trusts a ledger's answer (or that there is none) before asking again: a
# client submitting hundreds of jobs asks about once a second, not once a job. The workers'
# own check, before anything is submitted, is never cached.
USAGE_FRESH_S = 1.0
# A tenant without a ledger (no budget) is asked again only this often: every submission of
# every unbudgeted tenant would otherwise pay a call for nothing.
NO_LEDGER_FRESH_S = 5.0
# A client's read waits this long at most: a refusal is a courtesy, the workers' check holds
# an over-budget job whatever the client said.
USAGE_READ_TIMEOUT = timedelta(seconds=2)
# The ledgers `durable-comfy tenants` reads at once.
READ_AT_ONCE = 10


async def tenant_usage(
    temporal: Client, tenant: str, rpc_timeout: timedelta | None = None
) -> BudgetUsage | None:
    """The tenant's spend today as its ledger has it; None when it has no ledger (no budget,
    or none of its jobs was checked yet). A ledger whose worker does not answer raises."""
    handle = temporal.get_workflow_handle(ledger_id(tenant))
    try:
        usage: BudgetUsage = await handle.query(
            QUERY_LEDGER_USAGE, result_type=BudgetUsage, rpc_timeout=rpc_timeout
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    return usage


async def every_usage(temporal: Client) -> list[BudgetUsage]:
    """Every running ledger's reading, by tenant: found in the visibility store (each ledger is
    a `TenantLedger` workflow), each read by its query."""
    query = f"WorkflowType = '{LEDGER_WORKFLOW_TYPE}' AND ExecutionStatus = 'Running'"
    ids = [
        execution.id
        async for execution in temporal.list_workflows(query)
        if execution.status == WorkflowExecutionStatus.RUNNING
    ]
    gate = asyncio.Semaphore(READ_AT_ONCE)

    async def read(workflow_id: str) -> BudgetUsage | None:
        async with gate:
            handle = temporal.get_workflow_handle(workflow_id)
            try:
                found: BudgetUsage = await handle.query(QUERY_LEDGER_USAGE, result_type=BudgetUsage)
            except (RPCError, WorkflowQueryFailedError):
                return None  # closed meanwhile, or its worker did not answer
            return found

    usages = await asyncio.gather(*(read(workflow_id) for workflow_id in sorted(set(ids))))
    return sorted((u for u in usages if u is not None), key=lambda u: u.tenant)


@dataclass
class BudgetCheck:
    """Whether a client refuses a tenant's new job (`refusal`), each tenant's ledger asked at
    most once per `USAGE_FRESH_S`."""

    temporal: Client
    _answers: dict[str, tuple[BudgetUsage | None, float]] = field(default_factory=dict)
    _asking: dict[str, asyncio.Lock] = field(default_factory=dict)

    async def refusal(self, tenant: str) -> BudgetUsage | None:
        """The ledger's reading when the tenant's spend today has reached its budget and its
        settings say to refuse new jobs meanwhile; None: the job may be started. A ledger that
        cannot be read refuses nothing: the workers' check still holds the job."""
        usage = await self._usage(tenant)
        now = datetime.now(UTC)
        if usage is None or usage.over_budget != "refuse" or not usage.over_at(now):
            return None
        return usage

    async def _usage(self, tenant: str) -> BudgetUsage | None:
        async with self._asking.setdefault(tenant, asyncio.Lock()):
            known = self._answers.get(tenant)
            if known is not None:
                fresh_s = NO_LEDGER_FRESH_S if known[0] is None else USAGE_FRESH_S
                if time.monotonic() - known[1] < fresh_s:
                    return known[0]
            try:
                usage = await tenant_usage(self.temporal, tenant, USAGE_READ_TIMEOUT)
            except (RPCError, RPCTimeoutOrCancelledError, WorkflowQueryFailedError):
                usage = None
            self._answers[tenant] = (usage, time.monotonic())
            return usage


def budget_exceeded(usage: BudgetUsage) -> BudgetExceeded:
    """The refusal of a new job of a tenant over its budget, as the ledger's reading says it."""
    assert usage.resets_at is not None
    return BudgetExceeded(
        usage.tenant,
        usage.reason or f"tenant {usage.tenant!r} has spent its budget for today",
        usage.resets_at,
        spent_gpu_s=usage.gpu_s,
        gpu_seconds_per_day=usage.gpu_seconds_per_day,
        spent_usd=usage.usd,
        usd_per_day=usage.usd_per_day,
    )
