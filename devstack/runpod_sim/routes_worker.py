"""The worker-facing API the unmodified `runpod.serverless.start` loop (runpod 1.12.0; 1.7.x
likewise, without job-stop) talks to through RUNPOD_WEBHOOK_GET_JOB / _POST_OUTPUT /
_POST_STREAM / _PING:

- GET  job-take/{worker}?...&job_in_progress=0|1  -> 200 {id, input} or 204 (held open briefly)
- GET  job-take-batch/{worker}?...&batch_size=N   -> 200 [{id, input}, ...] or 204
- GET  job-stop/{worker}?...                      -> 200 {"jobsToStop": [ids]} or 204 (held open)
- POST job-done/{worker}/{job}?...&isStream=...   JSON body sent as form content type:
       {output} | {error} | {status: "IN_PROGRESS", output} (a progress update); stopPod: true
       asks for the worker to be replaced
- POST job-stream/{worker}/{job}?...              {output: chunk}
- GET  ping/{worker}?...&job_id=a,b&runpod_version=...  (or status=unhealthy&check&reason)
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog
from aiohttp import web

from .gate import error, worker_api
from .jobs import Job
from .runtime import SimRuntime, runtime_of
from .workers import Worker

log = structlog.get_logger("runpod_sim.worker_api")
routes = web.RouteTableDef()
V2 = "/v2/{endpoint_id}"
# A worker being stopped gets its empty answers after this pause, so a loop that re-polls at
# once (the SDK does after a 204) does not spin until the SIGTERM lands.
STOPPING_PAUSE_S = 0.1
# Real seconds before a stop signal the worker has not acted on goes out again.
STOP_RESEND_S = 1.5


def _job_view(job: Job) -> dict[str, Any]:
    return {"id": job.id, "input": job.input}


async def _take(request: web.Request, worker: Worker, batch_size: int | None) -> web.Response:
    rt = runtime_of(request)
    rt.platform.worker_polled(worker, request.query.get("job_in_progress") == "1")
    deadline = time.monotonic() + rt.settings.take_poll_s
    while True:
        if not worker.alive or rt.platform.shutting_down:
            await rt.table.changes.wait(STOPPING_PAUSE_S)
            return web.Response(status=204)
        # None for an unhealthy worker (the `unhealthy_workers` fault): its poll is held open as
        # an empty queue's, and answered once the fault is cleared.
        jobs = rt.platform.take(worker, batch_size or 1)
        if jobs:
            log.info("job taken", worker_id=worker.id, job_ids=[j.id for j in jobs])
            if batch_size is None:
                return web.json_response(_job_view(jobs[0]))
            return web.json_response([_job_view(j) for j in jobs])
        left = deadline - time.monotonic()
        if left <= 0:
            return web.Response(status=204)
        await rt.table.changes.wait(left)


@routes.get(f"{V2}/job-take/{{worker_id}}")
@worker_api
async def job_take(request: web.Request, worker: Worker) -> web.StreamResponse:
    return await _take(request, worker, None)


@routes.get(f"{V2}/job-take-batch/{{worker_id}}")
@worker_api
async def job_take_batch(request: web.Request, worker: Worker) -> web.StreamResponse:
    try:
        batch_size = max(1, int(request.query.get("batch_size", "1")))
    except ValueError:
        return error(400, "batch_size must be an integer")
    return await _take(request, worker, batch_size)


@routes.get(f"{V2}/job-stop/{{worker_id}}")
@worker_api
async def job_stop(request: web.Request, worker: Worker) -> web.StreamResponse:
    rt = runtime_of(request)
    deadline = time.monotonic() + rt.settings.stop_poll_s
    while True:
        now = time.monotonic()
        due = [
            j for j, sent in worker.to_stop.items() if sent is None or now - sent >= STOP_RESEND_S
        ]
        if due:
            for job_id in due:
                worker.to_stop[job_id] = now
            log.info("job-stop sent", worker_id=worker.id, job_ids=due)
            rt.table.changes.notify()  # a worker being stopped waits for this
            return web.json_response({"jobsToStop": due})
        left = deadline - now
        if left <= 0 or not worker.alive or rt.platform.shutting_down:
            return web.Response(status=204)
        resends = [sent + STOP_RESEND_S - now for sent in worker.to_stop.values() if sent]
        await rt.table.changes.wait(min([left, *resends]))


async def _json_object(request: web.Request) -> tuple[bytes, dict[str, Any] | None]:
    """The posted body: JSON, whatever the (form-urlencoded) content type says."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        return raw, None
    return raw, body if isinstance(body, dict) else None


def _late(rt: SimRuntime, job_id: str) -> web.Response:
    # A post for a job this worker no longer runs (cancelled, timed out, re-delivered; a stock
    # handler under runpod 1.7.x finishing a cancelled prompt): accepted and ignored, as the
    # platform has nothing left to update. What RunPod itself does with one is undocumented.
    known = rt.table.jobs.get(job_id)
    if known is None:
        return error(404, "unknown job")
    known.late_posts += 1
    return web.json_response({})


@routes.post(f"{V2}/job-done/{{worker_id}}/{{job_id}}")
@worker_api
async def job_done(request: web.Request, worker: Worker) -> web.StreamResponse:
    rt = runtime_of(request)
    job_id = request.match_info["job_id"]
    raw, body = await _json_object(request)
    if body is None:
        return error(400, "body is not a JSON object")
    job = rt.platform.active_on(worker, job_id)
    too_big = len(raw) > rt.settings.limit_bytes(rt.settings.max_result_mb)
    if body.get("status") == "IN_PROGRESS":
        if too_big:
            return error(400, "progress update too large")
        if job is None:
            return _late(rt, job_id)
        rt.platform.progress(worker, job, body.get("output"))
        return web.json_response({})
    if job is None:
        return _late(rt, job_id)
    refresh = bool(body.get("stopPod"))
    if too_big:
        rt.platform.lose_result(worker, job, f"result of {len(raw)} bytes refused", refresh)
        return error(400, "result too large")
    if rt.faults.take_lost_result():
        rt.platform.lose_result(worker, job, "result lost (simulated fault)", refresh)
        return error(400, "result refused (simulated fault)")
    rt.platform.result(worker, job, body)
    return web.json_response({})


@routes.post(f"{V2}/job-stream/{{worker_id}}/{{job_id}}")
@worker_api
async def job_stream(request: web.Request, worker: Worker) -> web.StreamResponse:
    rt = runtime_of(request)
    job_id = request.match_info["job_id"]
    raw, body = await _json_object(request)
    if body is None:
        return error(400, "body is not a JSON object")
    if len(raw) > rt.settings.limit_bytes(rt.settings.max_stream_chunk_mb):
        return error(400, f"stream chunk over {rt.settings.max_stream_chunk_mb:g} MB")
    job = rt.platform.active_on(worker, job_id)
    if job is None:
        return _late(rt, job_id)
    rt.platform.stream_chunk(job, body.get("output"))
    return web.json_response({})


@routes.get(f"{V2}/ping/{{worker_id}}")
@worker_api
async def ping(request: web.Request, worker: Worker) -> web.StreamResponse:
    rt = runtime_of(request)
    query = request.query
    if query.get("status") == "unhealthy":
        # The SDK's last word before os._exit(1) after a failed fitness check.
        failure = {"check": query.get("check", ""), "reason": query.get("reason", "")}
        worker.fitness_failures.append(failure)
        log.warning("worker reports a failed fitness check", worker_id=worker.id, **failure)
        return web.json_response({})
    worker.pings += 1
    worker.last_ping_at = rt.clock.now()
    worker.last_ping_jobs = [j for j in query.get("job_id", "").split(",") if j]
    return web.json_response({})
