"""Tenants' shares of the pools: `TenantConfig`, one per tenant of the `tenants` settings.

A tenant is the gateway's key's tenant, an SDK user's `labels.tenant`, else `local`. Each pool's
queue (workflows/admission.py) gives the tenants with jobs waiting starts in proportion to
their `weight`; `max_priority` is the best priority a tenant's job may ask for (1 is the best),
`max_pending` how many of its jobs may wait in one pool's queue before a new one is refused.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from workflows.admission import MAX_PRIORITY, MIN_PRIORITY


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(1.0, gt=0, le=1000)
    # The best (lowest) priority the tenant's jobs may ask for; 1: any.
    max_priority: int = Field(MIN_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # None: no bound of the tenant's own (a pool's `max_pending` may still apply).
    max_pending: int | None = Field(None, ge=1)


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
