"""Tenants' shares of the pools: `TenantConfig`, one per tenant of the `tenants` settings.

A tenant is the gateway's key's tenant, an SDK user's `labels.tenant`, else `local`. Each pool's
queue (workflows/admission.py) gives the tenants with jobs waiting starts in proportion to
their `weight`; `max_priority` is the best priority a tenant's job may ask for (1 is the best),
`max_pending` how many of its jobs may wait in one pool's queue before a new one is refused.

Its daily budget (docs/queue.md, "Budgets"): `gpu_seconds_per_day` and/or `usd_per_day` (None:
no such limit). A job whose check finds the tenant's spend today at a limit waits `PENDING`
(`admission.held: budget`) until the budget day resets; with `over_budget: refuse` a client
(the CLI, `JobClient`, the gateway) refuses a new job meanwhile (`BudgetExceeded`, 429). A
running job is never stopped by a budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workflows.admission import MAX_PRIORITY, MIN_PRIORITY
from workflows.budgets import BudgetLimits


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, gt=0, le=1000)
    # The best (lowest) priority the tenant's jobs may ask for; 1: any.
    max_priority: int = Field(MIN_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # None: no bound of the tenant's own (a pool's `max_pending` may still apply).
    max_pending: int | None = Field(None, ge=1)
    # The tenant's GPU allowance per budget day (`DURABLE_COMFY_BUDGET_DAY_S`, by default the
    # UTC day): GPU-seconds its jobs held a GPU, and/or their dollars where the pool has a
    # price. None: no such limit.
    gpu_seconds_per_day: float | None = Field(None, gt=0)
    usd_per_day: float | None = Field(None, gt=0)
    # Over budget: a new job waits PENDING until the reset (`wait`), or a client refuses it at
    # submission (`refuse`: `BudgetExceeded`, HTTP 429). A job already started waits either way.
    over_budget: Literal["wait", "refuse"] = "wait"

    @property
    def budgeted(self) -> bool:
        return self.gpu_seconds_per_day is not None or self.usd_per_day is not None


DEFAULT_TENANT_CONFIG = TenantConfig()


def tenant_config(tenants: Mapping[str, TenantConfig], tenant: str) -> TenantConfig:
    """The tenant's settings: its own entry, else the `default` entry, else the defaults."""
    return tenants.get(tenant) or tenants.get("default") or DEFAULT_TENANT_CONFIG


def priority_refusal(tenants: Mapping[str, TenantConfig], tenant: str, priority: int) -> str | None:
    """Why the tenant may not ask for `priority` (None: it may): the worker's check, and the
    gateway's before the job is started."""
    best = tenant_config(tenants, tenant).max_priority
    if priority >= best:
        return None
    return (
        f"priority {priority} is not allowed for tenant {tenant!r}: its best is {best} "
        f"(ask for {best} to {MAX_PRIORITY})"
    )


def budget_limits(
    tenants: Mapping[str, TenantConfig], tenant: str, day_s: float
) -> BudgetLimits | None:
    """The tenant's budget as its ledger keeps it (workflows/budget_ledger.py); None: it has
    none, and its jobs never ask a ledger."""
    terms = tenant_config(tenants, tenant)
    if not terms.budgeted:
        return None
    return BudgetLimits(
        tenant=tenant,
        gpu_seconds_per_day=terms.gpu_seconds_per_day,
        usd_per_day=terms.usd_per_day,
        over_budget=terms.over_budget,
        day_s=day_s,
    )
