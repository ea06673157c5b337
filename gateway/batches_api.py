"""The batch routes (docs/http-api.md, Batches): submit, status, results, cancel, and the
status pushed as Server-Sent Events. Like the job routes, every one checks the caller's key and
rate first, and the batch's tenant before anything else about it.

A batch is many ordinary jobs (each also at `/v1/jobs/{id}`) and one workflow that counts
them (workflows/batches.py); the client library does the work (`JobClient.submit_batch`,
`batch_status`, ...), this module the HTTP around it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Final

import structlog
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from configuration.tenants import priority_refusal
from gateway.batch_submission import BATCH, ParsedBatch, batch_id_for, batch_request
from gateway.deps import caller, request_slot
from gateway.errors import QueueFull, TooManyJobs, priority_not_allowed
from gateway.feed import StreamEvent
from gateway.state import Gateway, gateway_of
from gateway.stream_api import sse_response
from gateway.submission import cancel_reason, parse_body
from gateway.views import batch_etag, batch_links, batch_owner, batch_view, etag_matches
from gateway.webhook_check import check_webhook_at
from starter import errors as client_errors
from starter.client import JobClient
from starter.errors import BatchNotFound
from workflows.batches import BatchJobEnd, BatchRequest, BatchStatus

log = structlog.get_logger("gateway.batches")

router = APIRouter(prefix="/v1", dependencies=[Depends(request_slot)], tags=["batches"])
# The stream holds a stream slot, not one of the replica's request slots, for as long as it
# is open (as the jobs' streams do: gateway.stream_api).
events_router = APIRouter(prefix="/v1", tags=["events"])

Tenant = Annotated[str, Depends(caller)]

# How often a stream asks for its batch's status: one query of the batch and, while jobs run,
# one list call of Temporal's visibility; a second is as fresh as visibility is anyway.
BATCH_POLL_S: Final = 1.0
# Presigning a batch's results reads each job's link lifetime once (then kept): a few at a
# time, as the client starts a batch's jobs.
PRESIGNS_AT_ONCE: Final = 32


class BatchSubmission(BatchRequest):
    """The body of `POST /v1/batches` as OpenAPI shows it (the route reads it itself, bounded)."""

    detached: bool = Field(
        True,
        description="false: each job is abandoned when no client follows it for its "
        "policy.abandon_after_s",
    )


BATCH_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/BatchSubmission"}}
        },
    }
}


def _json(body: Any, status_code: int = 200, **headers: str) -> JSONResponse:
    return JSONResponse(body, status_code=status_code, headers=headers)


async def _owned(gateway: Gateway, batch_id: str, tenant: str) -> JobClient:
    client = await gateway.client()
    await gateway.facts.check_batch_tenant(client, batch_id, tenant)
    return client


@router.post("/batches", status_code=201, openapi_extra=BATCH_BODY)
async def submit_batch(
    request: Request,
    tenant: Tenant,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    """Submit a batch: many jobs, started whole or not at all. The same Idempotency-Key with the
    same body is the same batch (200), with another body 409 `BatchConflict`.

    Refused 429 as a job is, for the batch's jobs together: `TooManyJobs` when they would take
    the tenant past its open jobs, `QueueFull` when a pool's queue has no room for them all."""
    gateway = gateway_of(request)
    batch_id = batch_id_for(tenant, idempotency_key)
    body = parse_body(await request.body(), "BatchRequest", BATCH)
    client = await gateway.client()
    storage = client.store.settings if client.store is not None else None
    parsed = batch_request(body, tenant, storage)
    await _check_jobs(gateway, parsed, tenant)
    try:
        await gateway.limits.admit_job(tenant, client, jobs=len(parsed.jobs))
    except TooManyJobs:
        # A repeat of a batch that got in is answered, not counted again.
        if idempotency_key is None or not await _exists(client, batch_id):
            raise
    try:
        submitted = await client.submit_batch(
            parsed.batch, batch_id=batch_id, detached=parsed.detached
        )
    except client_errors.QueueFull as exc:
        log.info("queue_full", tenant=tenant, pool=exc.pool, retry_after_s=exc.retry_after_s)
        raise QueueFull.of(exc) from None
    gateway.facts.record_batch_tenant(batch_id, submitted.job_ids, tenant)
    status = submitted.status
    view = batch_view(status, gateway.settings.base_path)
    log.info(
        "batch_submitted",
        batch_id=batch_id,
        tenant=tenant,
        jobs=len(submitted.job_ids),
        started=submitted.started,
        existed=submitted.existed,
    )
    headers = {"Location": view["links"]["self"], "ETag": batch_etag(status)}
    return _json(view, 200 if submitted.existed else 201, **headers)


async def _check_jobs(gateway: Gateway, parsed: ParsedBatch, tenant: str) -> None:
    """What `POST /v1/jobs` checks beyond the body, for every job: its priority (403) and its
    webhook's URL (422 at the job's place), each distinct one once; and the batch's webhook."""
    for priority in sorted({job.priority for job in parsed.jobs}):
        refusal = priority_refusal(gateway.settings.tenants, tenant, priority)
        if refusal is not None:
            raise priority_not_allowed(refusal)
    urls: dict[str, list[str | int]] = {}
    if parsed.batch.webhook is not None:
        urls[parsed.batch.webhook.url] = ["webhook", "url"]
    for index, job in enumerate(parsed.jobs):
        if job.webhook is not None and job.webhook.url not in urls:
            # The jobs sent with `count` or `overrides` share the one `request`'s webhook.
            place = ["requests", index] if parsed.batch.requests is not None else ["request"]
            urls[job.webhook.url] = [*place, "webhook", "url"]
    for url, loc in urls.items():
        await check_webhook_at(url, loc, gateway.settings.webhook_allow_hosts)


async def _exists(client: JobClient, batch_id: str) -> bool:
    try:
        await batch_owner(client, batch_id)
    except BatchNotFound:
        return False
    return True


@router.get("/batches/{batch_id}")
async def batch_status(
    request: Request,
    batch_id: str,
    tenant: Tenant,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
    jobs: Annotated[
        bool,
        Query(description="true: each unfinished job's state and percent too (a costlier read)"),
    ] = False,
) -> Response:
    """The batch: counts by state, progress, cost, artifacts, and each job (an unfinished
    job's state only with `?jobs=true`)."""
    gateway = gateway_of(request)
    client = await _owned(gateway, batch_id, tenant)
    status = await client.batch_status(batch_id, jobs=jobs)
    tag = batch_etag(status)
    headers = {"ETag": tag, "Cache-Control": "no-cache"}
    if if_none_match is not None and etag_matches(if_none_match, tag):
        return Response(status_code=304, headers=headers)
    return _json(batch_view(status, gateway.settings.base_path), 200, **headers)


@router.get("/batches/{batch_id}/results")
async def batch_results(request: Request, batch_id: str, tenant: Tenant) -> JSONResponse:
    """Every ended job's end (state, error, cost), its artifacts each with a fresh presigned
    `url` as a job's get."""
    gateway = gateway_of(request)
    client = await _owned(gateway, batch_id, tenant)
    results = await client.batch_results(batch_id, presign=False)
    base = gateway.settings.base_path
    gate = asyncio.Semaphore(PRESIGNS_AT_ONCE)

    async def shown(end: BatchJobEnd) -> dict[str, Any]:
        view = end.model_dump(mode="json")
        async with gate:
            view["artifacts"] = await gateway.views.artifacts(end.job_id, end.artifacts)
        view["links"] = {"self": f"{base}/v1/jobs/{end.job_id}"}
        return view

    ends = await asyncio.gather(*(shown(end) for end in results.ends))
    return _json(
        {
            "batch_id": batch_id,
            "state": str(results.state),
            "ends": list(ends),
            "links": batch_links(base, batch_id),
        }
    )


@router.post("/batches/{batch_id}/cancel", status_code=202)
async def cancel_batch(request: Request, batch_id: str, tenant: Tenant) -> JSONResponse:
    """Stop every unfinished job of the batch (each confirmed as a cancelled job is); the
    batch is CANCELLING until every job has ended. A batch that has ended stays as it is."""
    gateway = gateway_of(request)
    reason = cancel_reason(await request.body())
    client = await _owned(gateway, batch_id, tenant)
    status = await client.cancel_batch(
        batch_id, reason or f"batch cancelled by tenant {tenant} (HTTP)"
    )
    log.info("batch_cancel_sent", batch_id=batch_id, tenant=tenant)
    return _json(batch_view(status, gateway.settings.base_path), 202)


@events_router.get("/batches/{batch_id}/events", response_class=StreamingResponse)
async def batch_events(
    request: Request, batch_id: str, tenant: Annotated[str, Depends(caller)]
) -> StreamingResponse:
    """Server-Sent Events: the batch's status now, then each time it changes, then `end`."""
    gateway = gateway_of(request)
    client = await _owned(gateway, batch_id, tenant)
    slot = gateway.limits.in_stream()
    await slot.__aenter__()
    view = functools.partial(batch_view, base_path=gateway.settings.base_path)
    heartbeat_s = gateway.settings.heartbeat_s
    events = batch_stream(client, batch_id, view, BATCH_POLL_S, heartbeat_s)
    return sse_response(events, slot, batch_id=batch_id)


async def batch_stream(
    client: JobClient,
    batch_id: str,
    view: Callable[[BatchStatus], dict[str, Any]],
    poll_s: float,
    heartbeat_s: float,
) -> AsyncIterator[StreamEvent | None]:
    """A `status` event (id: the batch's `seq`) now and whenever its state, `seq` or counts
    change; None for each `heartbeat_s` without one; after the terminal status, `end`.

    Each event is the whole status, so a client that reconnects misses nothing: its first
    event is the batch as it is then."""
    last: tuple[Any, ...] | None = None
    quiet_since = time.monotonic()
    while True:
        status = await client.batch_status(batch_id)
        # Progress too: running jobs' percents move the bar between two ends.
        shown = (
            str(status.state),
            status.seq,
            tuple(sorted(status.counts.items())),
            status.progress,
        )
        now = time.monotonic()
        if shown != last or status.terminal:
            last, quiet_since = shown, now
            yield StreamEvent("status", str(status.seq), view(status))
            if status.terminal:
                yield StreamEvent("end", str(status.seq), {"state": str(status.state)})
                return
        elif now - quiet_since >= heartbeat_s:
            quiet_since = now
            yield None
        await asyncio.sleep(poll_s)
