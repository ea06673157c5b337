"""The job routes that answer once (docs/http-api.md, Routes): submit, status, artifacts,
cancel, resume, list. Every one checks the caller's key and rate first, and the job's tenant
before anything else about it."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from configuration.tenants import priority_refusal
from gateway.deps import caller, request_slot
from gateway.errors import (
    BudgetExceeded,
    QueueFull,
    TooManyJobs,
    bad_request,
    invalid,
    priority_not_allowed,
)
from gateway.state import Gateway, gateway_of
from gateway.submission import cancel_reason, job_id_for, job_request, parse_body, resubmit_of
from gateway.views import etag, etag_matches
from gateway.webhook_check import check_webhook
from starter import errors as client_errors
from starter.client import JobClient
from starter.errors import ClientError, JobNotFound, JobUnanswered
from workflows.contracts import JobRequest, JobState
from workflows.shared import SA_JOB_POOL, SA_JOB_PROGRESS, SA_JOB_STATE, SA_TENANT, WORKFLOW_TYPE

log = structlog.get_logger("gateway.jobs")

router = APIRouter(prefix="/v1", dependencies=[Depends(request_slot)], tags=["jobs"])

Tenant = Annotated[str, Depends(caller)]
_POOL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class JobSubmission(JobRequest):
    """The body of `POST /v1/jobs` as OpenAPI shows it (the route reads it itself, bounded)."""

    detached: bool = Field(
        True, description="false: abandoned when no client follows it for policy.abandon_after_s"
    )


SUBMISSION_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobSubmission"}}},
    }
}


async def _owned(gateway: Gateway, job_id: str, tenant: str) -> JobClient:
    client = await gateway.client()
    await gateway.facts.check_tenant(client, job_id, tenant)
    return client


def _json(body: Any, status_code: int = 200, **headers: str) -> JSONResponse:
    return JSONResponse(body, status_code=status_code, headers=headers)


@router.post("/jobs", status_code=201, openapi_extra=SUBMISSION_BODY)
async def submit_job(
    request: Request,
    tenant: Tenant,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JSONResponse:
    """Submit a job: the same Idempotency-Key with the same request is the same job (200).

    Three refusals for capacity, all 429 with Retry-After: `TooManyJobs`, this gateway's cap
    on the tenant's open jobs of every pool (counted here, in Temporal's visibility);
    `QueueFull`, the pool queue's cap on the jobs waiting in it (the workers' `max_pending`,
    checked by the client library against the queue itself); and `BudgetExceeded`, the
    tenant's daily budget spent with `over_budget: refuse` (its ledger read by the client
    library; Retry-After: until the reset)."""
    gateway = gateway_of(request)
    job_id = job_id_for(tenant, idempotency_key)
    body = parse_body(await request.body())
    client = await gateway.client()
    storage = client.store.settings if client.store is not None else None
    job, detached = job_request(body, tenant, storage)
    refusal = priority_refusal(gateway.settings.tenants, tenant, job.priority)
    if refusal is not None:
        raise priority_not_allowed(refusal)
    await check_webhook(job, gateway.settings.webhook_allow_hosts)
    try:
        await gateway.limits.admit_job(tenant, client)
    except TooManyJobs:
        # A repeat of a submission that got in is answered, not counted again.
        if idempotency_key is None or not await _exists(client, job_id):
            raise
    try:
        outcome = await client.start(job, job_id=job_id, detached=detached)
        status, existed = outcome.status, outcome.existed
    except client_errors.QueueFull as exc:
        log.info("queue_full", tenant=tenant, pool=exc.pool, retry_after_s=exc.retry_after_s)
        raise QueueFull.of(exc) from None
    except client_errors.BudgetExceeded as exc:
        log.info("budget_exceeded", tenant=tenant, resets_at=exc.resets_at.isoformat())
        raise BudgetExceeded(exc) from None
    except JobUnanswered:
        # Raised only once the ID was found holding this very request: the same job, whose
        # status no worker gives now. Temporal's record of it is the answer.
        status, existed = await client.recorded_status(job_id), True
    gateway.facts.record_tenant(job_id, tenant)
    view = await gateway.views.status(status)
    log.info("job_submitted", job_id=job_id, tenant=tenant, existed=existed)
    headers = {"Location": view["links"]["self"], "ETag": etag(status)}
    return _json(view, 200 if existed else 201, **headers)


async def _exists(client: JobClient, job_id: str) -> bool:
    try:
        await client.tenant_of(job_id)
    except JobNotFound:
        return False
    return True


@router.get("/jobs/{job_id}")
async def job_status(
    request: Request,
    job_id: str,
    tenant: Tenant,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match")] = None,
) -> Response:
    """The job's authoritative status; counts as client contact for an attached job."""
    gateway = gateway_of(request)
    client = await _owned(gateway, job_id, tenant)
    status = await client.status(job_id)
    if not status.terminal and not status.detached:
        if gateway.contact.due(job_id, status.abandon_after_s):
            try:
                await client.client_seen(job_id)
            except ClientError as exc:
                # Contact is best effort: the status is still the answer.
                log.warning("client_seen_failed", job_id=job_id, error=type(exc).__name__)
    tag = etag(status)
    headers = {"ETag": tag, "Cache-Control": "no-cache"}
    if if_none_match is not None and etag_matches(if_none_match, tag):
        return Response(status_code=304, headers=headers)
    return _json(await gateway.views.status(status), 200, **headers)


@router.get("/jobs/{job_id}/artifacts")
async def job_artifacts(request: Request, job_id: str, tenant: Tenant) -> JSONResponse:
    """The outputs stored so far, each with a fresh presigned `url`."""
    gateway = gateway_of(request)
    client = await _owned(gateway, job_id, tenant)
    status = await client.status(job_id)
    artifacts = await gateway.views.artifacts(job_id, status.artifacts)
    return _json({"job_id": job_id, "state": status.state.value, "artifacts": artifacts})


@router.post("/jobs/{job_id}/cancel", status_code=202)
async def cancel_job(request: Request, job_id: str, tenant: Tenant) -> JSONResponse:
    """Stop the job (confirmed: it ends CANCELLED once its prompt is gone)."""
    gateway = gateway_of(request)
    reason = cancel_reason(await request.body())
    client = await _owned(gateway, job_id, tenant)
    status = await client.cancel(job_id, reason or f"cancelled by tenant {tenant} (HTTP)")
    log.info("job_cancel_sent", job_id=job_id, tenant=tenant)
    return _json(await gateway.views.status(status), 202)


@router.post("/jobs/{job_id}/resume")
async def resume_job(request: Request, job_id: str, tenant: Tenant) -> JSONResponse:
    """Answer a job in NEEDS_DECISION: re-attach, or resubmit (paid again)."""
    gateway = gateway_of(request)
    resubmit = resubmit_of(await request.body())
    client = await _owned(gateway, job_id, tenant)
    status = await client.resume(job_id, resubmit=resubmit)
    log.info("job_resumed", job_id=job_id, tenant=tenant, resubmit=resubmit)
    return _json(await gateway.views.status(status))


@router.get("/jobs")
async def list_jobs(
    request: Request,
    tenant: Tenant,
    state: str | None = None,
    pool: str | None = None,
    page_size: Annotated[int, Query(ge=1, le=200)] = 50,
    page_token: str | None = None,
) -> JSONResponse:
    """The caller's jobs, newest first, a page at a time."""
    gateway = gateway_of(request)
    query = f'WorkflowType = "{WORKFLOW_TYPE}" AND {SA_TENANT} = "{tenant}"'
    if state is not None:
        try:
            query += f' AND {SA_JOB_STATE} = "{JobState(state.upper()).value}"'
        except ValueError:
            states = ", ".join(s.value for s in JobState)
            raise invalid([{"loc": ["query", "state"], "message": f"one of {states}"}]) from None
    if pool is not None:
        if not _POOL.match(pool):
            raise invalid([{"loc": ["query", "pool"], "message": "1-64 of A-Z a-z 0-9 _ . -"}])
        query += f' AND {SA_JOB_POOL} = "{pool}"'
    token = _token(page_token)
    client = await gateway.client()
    executions, next_token = await client.list_page(query, page_size=page_size, page_token=token)
    jobs = []
    for execution in executions:
        attributes = {key.name: value for key, value in execution.typed_search_attributes}
        progress = attributes.get(SA_JOB_PROGRESS)
        jobs.append(
            {
                "job_id": execution.id,
                "state": attributes.get(SA_JOB_STATE),
                "progress": progress if isinstance(progress, int) else None,
                "pool": attributes.get(SA_JOB_POOL),
                "created_at": execution.start_time.isoformat(),
            }
        )
    shown = base64.urlsafe_b64encode(next_token).decode() if next_token else None
    return _json({"jobs": jobs, "next_page_token": shown})


def _token(page_token: str | None) -> bytes | None:
    if page_token is None:
        return None
    try:
        return base64.urlsafe_b64decode(page_token.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise bad_request("page_token is the next_page_token of an earlier page") from None
