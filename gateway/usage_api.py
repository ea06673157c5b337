"""`GET /v1/usage`: the caller's tenant's spend today against its daily budget, as its ledger
(workflows/budget_ledger.py) has it. Like every `/v1` route it checks the caller's key and rate
first."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from temporalio.client import WorkflowQueryFailedError

from configuration.tenants import tenant_config
from gateway.deps import caller, request_slot
from gateway.errors import UNAVAILABLE_RETRY_AFTER_S, ApiError, retry_after
from gateway.state import gateway_of
from workflows.budgets import BudgetUsage

log = structlog.get_logger("gateway.usage")

router = APIRouter(prefix="/v1", dependencies=[Depends(request_slot)], tags=["usage"])

Tenant = Annotated[str, Depends(caller)]


def usage_view(
    tenant: str, usage: BudgetUsage | None, now: datetime, **limits: Any
) -> dict[str, Any]:
    """The tenant's usage as the API shows it; without a ledger, nothing spent and the limits
    the gateway's own tenant settings give (`limits`)."""
    if usage is None:
        return {
            "tenant": tenant,
            "budgeted": any(value is not None for value in limits.values()),
            "gpu_s": 0.0,
            "usd": 0.0,
            "jobs": 0,
            "limits": limits,
            "over_budget": None,
            "over": False,
            "reason": "",
            "day_started_at": None,
            "resets_at": None,
            "as_of": now.isoformat(),
        }
    over = usage.over_at(now)
    return {
        "tenant": tenant,
        "budgeted": True,
        "gpu_s": usage.gpu_s,
        "usd": usage.usd,
        "jobs": usage.jobs,
        "limits": {
            "gpu_seconds_per_day": usage.gpu_seconds_per_day,
            "usd_per_day": usage.usd_per_day,
        },
        "over_budget": usage.over_budget,
        "over": over,
        "reason": usage.reason if over else "",
        "day_started_at": usage.day_started_at.isoformat() if usage.day_started_at else None,
        "resets_at": usage.resets_at.isoformat() if usage.resets_at else None,
        "as_of": (usage.as_of or now).isoformat(),
    }


@router.get("/usage")
async def usage(request: Request, tenant: Tenant) -> JSONResponse:
    """The caller's tenant's spend today (GPU-seconds, dollars, jobs counted), its limits, and
    whether it is over them until `resets_at`. A tenant without a budget shows nothing spent."""
    gateway = gateway_of(request)
    client = await gateway.client()
    try:
        async with asyncio.timeout(client.query_timeout.total_seconds()):
            found = await client.tenant_usage(tenant)
    except (TimeoutError, WorkflowQueryFailedError) as exc:
        log.info("budget_ledger_unanswered", tenant=tenant, error=type(exc).__name__)
        raise ApiError(
            503,
            "LedgerUnanswered",
            "the tenant's budget ledger did not answer (no worker serves it now): try again",
            headers=retry_after(UNAVAILABLE_RETRY_AFTER_S),
        ) from None
    terms = tenant_config(gateway.settings.tenants, tenant)
    view = usage_view(
        tenant,
        found,
        datetime.now(UTC),
        gpu_seconds_per_day=terms.gpu_seconds_per_day,
        usd_per_day=terms.usd_per_day,
    )
    return JSONResponse(view)
