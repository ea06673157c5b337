"""RunPod's public serverless API under /v2/{endpoint_id}/ (see PROTOCOLS.md)."""

from __future__ import annotations

import json
import time
from typing import Any

import structlog
from aiohttp import web
from pydantic import ValidationError

from .gate import error, public
from .jobs import Job
from .models import RunRequest
from .runtime import SimRuntime, runtime_of
from .views import status_body

log = structlog.get_logger("runpod_sim.public")
routes = web.RouteTableDef()
V2 = "/v2/{endpoint_id}"
NOT_FOUND = "request does not exist"
WAIT_MS_RANGE = (1000, 300_000)


async def _submission(request: web.Request, limit_mb: float) -> RunRequest | web.Response:
    rt = runtime_of(request)
    raw = await request.read()
    limit = rt.settings.limit_bytes(limit_mb)
    if len(raw) > limit:
        return error(413, f"request body of {len(raw)} bytes exceeds the {limit_mb:g} MB limit")
    try:
        return RunRequest.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as exc:
        return error(400, f"invalid request: {exc}")


def _job_or_404(request: web.Request) -> Job | None:
    return runtime_of(request).table.visible(request.match_info["job_id"])


@routes.post(f"{V2}/run")
@public("run")
async def run(request: web.Request) -> web.StreamResponse:
    rt = runtime_of(request)
    parsed = await _submission(request, rt.settings.max_run_body_mb)
    if isinstance(parsed, web.Response):
        return parsed
    job = rt.platform.submit(parsed, sync=False)
    if rt.faults.take_drop_run_answer():
        log.warning("fault: dropping the /run answer", job_id=job.id)
        _drop_connection(request)
    return web.json_response({"id": job.id, "status": job.status})


def _drop_connection(request: web.Request) -> None:
    """Close the connection with no answer at all: the job exists, the client cannot know. The
    response returned afterwards fails to write, which aiohttp takes for a client gone away."""
    transport = request.transport
    if transport is not None:
        transport.abort()


@routes.post(f"{V2}/runsync")
@public("runsync")
async def runsync(request: web.Request) -> web.StreamResponse:
    rt = runtime_of(request)
    try:
        wait_ms = int(request.query.get("wait", rt.settings.runsync_default_wait_ms))
    except ValueError:
        return error(400, "wait must be an integer number of milliseconds")
    wait_ms = min(max(wait_ms, WAIT_MS_RANGE[0]), WAIT_MS_RANGE[1])
    parsed = await _submission(request, rt.settings.max_runsync_body_mb)
    if isinstance(parsed, web.Response):
        return parsed
    job = rt.platform.submit(parsed, sync=True)
    await _wait_for_end(rt, job, rt.clock.real_seconds(wait_ms / 1000))
    return web.json_response(status_body(job))


async def _wait_for_end(rt: SimRuntime, job: Job, real_s: float) -> None:
    deadline = time.monotonic() + real_s
    while not job.terminal and not job.gone and not rt.platform.shutting_down:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await rt.table.changes.wait(left)


@routes.get(f"{V2}/status/{{job_id}}")
@public("status")
async def status(request: web.Request) -> web.StreamResponse:
    job = _job_or_404(request)
    if job is None:
        return error(404, NOT_FOUND)
    return web.json_response(status_body(job))


@routes.get(f"{V2}/stream/{{job_id}}")
@public("stream")
async def stream(request: web.Request) -> web.StreamResponse:
    """The chunks not returned yet; held open briefly while there are none and the job runs."""
    rt = runtime_of(request)
    job = _job_or_404(request)
    if job is None:
        return error(404, NOT_FOUND)
    deadline = time.monotonic() + rt.settings.stream_poll_s
    while len(job.stream) == job.stream_sent and not job.terminal and not job.gone:
        left = deadline - time.monotonic()
        if left <= 0 or rt.platform.shutting_down:
            break
        await rt.table.changes.wait(left)
    chunks: list[Any] = job.stream[job.stream_sent :]
    job.stream_sent = len(job.stream)
    return web.json_response({"status": job.status, "stream": [{"output": c} for c in chunks]})


@routes.post(f"{V2}/cancel/{{job_id}}")
@public("cancel")
async def cancel(request: web.Request) -> web.StreamResponse:
    rt = runtime_of(request)
    job = _job_or_404(request)
    if job is None:
        return error(404, NOT_FOUND)
    if not job.terminal:
        rt.platform.cancel(job)
    return web.json_response({"id": job.id, "status": job.status})


@routes.post(f"{V2}/retry/{{job_id}}")
@public("retry")
async def retry(request: web.Request) -> web.StreamResponse:
    rt = runtime_of(request)
    job = _job_or_404(request)
    if job is None:
        return error(404, NOT_FOUND)
    if not rt.platform.retry(job):
        return error(400, f"job is {job.status}: only FAILED or TIMED_OUT jobs can be retried")
    return web.json_response({"id": job.id, "status": job.status})


@routes.post(f"{V2}/purge-queue")
@public("purge-queue")
async def purge_queue(request: web.Request) -> web.StreamResponse:
    removed = runtime_of(request).table.purge_queue()
    return web.json_response({"removed": removed, "status": "completed"})


@routes.get(f"{V2}/health")
@public("health")
async def health(request: web.Request) -> web.StreamResponse:
    return web.json_response(runtime_of(request).platform.health())
