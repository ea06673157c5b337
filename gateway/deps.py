"""Who is calling, and whether the gateway and the caller's budget let them in: the checks
every `/v1` route runs before its own work."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request

from gateway.state import gateway_of


async def request_slot(request: Request) -> AsyncIterator[None]:
    """One of the replica's concurrent requests, held for the request (503 Overloaded)."""
    async with gateway_of(request).limits.in_request():
        yield


async def caller(request: Request) -> str:
    """The caller's tenant (401 without a valid key), counted against its rate (429)."""
    gateway = gateway_of(request)
    tenant = gateway.keys.tenant_for(request.headers.get("authorization"))
    gateway.limits.request(tenant)
    return tenant
