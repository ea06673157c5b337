"""The pools' routes (docs/http-api.md, Routes): a bounded pool's queue as the caller's tenant
may see it. Like every `/v1` route it checks the caller's key and rate first."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from typing import Annotated

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from temporalio.client import WorkflowQueryFailedError

from gateway.deps import caller, request_slot
from gateway.errors import UNAVAILABLE_RETRY_AFTER_S, ApiError, invalid, retry_after
from gateway.state import gateway_of
from gateway.views import queue_view

log = structlog.get_logger("gateway.pools")

router = APIRouter(prefix="/v1", dependencies=[Depends(request_slot)], tags=["pools"])

Tenant = Annotated[str, Depends(caller)]
# A pool's name as a request gives it (workflows.contracts.JobRequest.pool).
POOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _unanswered(pool: str) -> ApiError:
    return ApiError(
        503,
        "PoolQueueUnanswered",
        f"the queue of pool {pool!r} did not answer (no worker serves it now): try again shortly",
        headers=retry_after(UNAVAILABLE_RETRY_AFTER_S),
        pool=pool,
    )


@router.get("/pools/{pool}/queue")
async def pool_queue(request: Request, pool: str, tenant: Tenant) -> JSONResponse:
    """A bounded pool's queue: the caller's own jobs in it (waiting and running, with their
    place, priority and age), and only totals for everyone else's. 404 `NoPoolQueue` when no
    queue runs for the pool (unbounded, or no job has asked for one of its slots yet)."""
    if not POOL_NAME.match(pool):
        raise invalid([{"loc": ["path", "pool"], "message": "1-64 of A-Z a-z 0-9 _ . -"}])
    gateway = gateway_of(request)
    client = await gateway.client()
    try:
        # The query waits for a worker to answer: bounded as a status query is.
        async with asyncio.timeout(client.query_timeout.total_seconds()):
            view = await client.pool_queue(pool)
    except (TimeoutError, WorkflowQueryFailedError) as exc:
        log.info("pool_queue_unanswered", pool=pool, error=type(exc).__name__)
        raise _unanswered(pool) from None
    return JSONResponse(queue_view(view, tenant, datetime.now(UTC)))
