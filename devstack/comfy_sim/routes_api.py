"""ComfyUI's JSON API: /prompt, /queue, /history, /interrupt, /free, /api/jobs, /system_stats,
/object_info and friends. Every route is also served under /api (see server.py)."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

import structlog
from aiohttp import web

from .jobs import STATUSES, get_all_jobs, get_job
from .nodes import REGISTRY, node_info
from .runtime import json_body, runtime_of, server_error
from .settings import SIM_VERSION
from .validation import validate_prompt

log = structlog.get_logger("comfy_sim.api")
routes = web.RouteTableDef()
# Only under /api in ComfyUI too (registered with the prefix in its route table).
api_only_routes = web.RouteTableDef()


@routes.post("/prompt")
async def post_prompt(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    try:
        body = await json_body(request)
        if not isinstance(body, dict):
            raise TypeError("body is not an object")
    except (ValueError, TypeError):
        return server_error()
    if "number" in body:
        number: float | int = float(body["number"])
    else:
        number = -rt.number if body.get("front") else rt.number
        rt.number += 1
    if "prompt" not in body:
        error = {
            "type": "no_prompt",
            "message": "No prompt provided",
            "details": "No prompt provided",
            "extra_info": {},
        }
        rt.stats.rejected += 1
        return web.json_response({"error": error, "node_errors": {}}, status=400)
    prompt = body["prompt"]
    if not isinstance(prompt, dict):
        return server_error()  # ComfyUI's validate_prompt raises on a non-object prompt
    prompt_id = str(body.get("prompt_id", uuid.uuid4()))
    result = validate_prompt(prompt, rt.settings, body.get("partial_execution_targets"))
    extra_data = dict(body.get("extra_data") or {})
    if "client_id" in body:
        extra_data["client_id"] = body["client_id"]
    extra_data["create_time"] = int(time.time() * 1000)
    if not result.ok:
        rt.stats.rejected += 1
        log.warning("invalid prompt", prompt_id=prompt_id, error=result.error)
        return web.json_response(
            {"error": result.error, "node_errors": result.node_errors}, status=400
        )
    log.info("got prompt", prompt_id=prompt_id)
    rt.queue.put([number, prompt_id, prompt, extra_data, result.outputs])
    rt.stats.prompts[prompt_id] += 1
    # The most prompts queued and running at once: what a bounded pool must never pass.
    rt.stats.peak_in_queue = max(rt.stats.peak_in_queue, rt.queue.remaining())
    return web.json_response(
        {"prompt_id": prompt_id, "number": number, "node_errors": result.node_errors}
    )


@routes.get("/prompt")
async def get_prompt(request: web.Request) -> web.Response:
    return web.json_response(runtime_of(request).queue.queue_info())


@routes.get("/queue")
async def get_queue(request: web.Request) -> web.Response:
    running, pending = runtime_of(request).queue.snapshot()
    return web.json_response({"queue_running": running, "queue_pending": pending})


@routes.post("/queue")
async def post_queue(request: web.Request) -> web.Response:
    queue = runtime_of(request).queue
    try:
        body = await json_body(request)
    except ValueError:
        return server_error()
    if body.get("clear"):
        queue.wipe()
    for prompt_id in body.get("delete", []):
        queue.delete(prompt_id)
    return web.Response(status=200)


@routes.get("/history")
async def get_history(request: web.Request) -> web.Response:
    max_items = request.query.get("max_items")
    offset = request.query.get("offset")
    history = runtime_of(request).queue.get_history(
        max_items=int(max_items) if max_items is not None else None,
        offset=int(offset) if offset is not None else -1,
    )
    return web.json_response(history)


@routes.get("/history/{prompt_id}")
async def get_history_item(request: web.Request) -> web.Response:
    queue = runtime_of(request).queue
    return web.json_response(queue.get_history(prompt_id=request.match_info["prompt_id"]))


@routes.post("/history")
async def post_history(request: web.Request) -> web.Response:
    queue = runtime_of(request).queue
    try:
        body = await json_body(request)
    except ValueError:
        return server_error()
    if body.get("clear"):
        queue.history.clear()
    for prompt_id in body.get("delete", []):
        queue.history.pop(prompt_id, None)
    return web.Response(status=200)


@routes.post("/interrupt")
async def post_interrupt(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    try:
        body = await json_body(request)
    except json.JSONDecodeError:
        body = {}
    prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
    rt.stats.interrupts.append(prompt_id or None)
    running = rt.queue.running_prompt_ids()
    if not prompt_id:
        # Global interrupts set the flag even when idle; the next prompt clears it on start.
        # In parallel mode (simulator only) every executor's running prompt is hit.
        for executor in rt.executors:
            executor.interrupt()
    elif prompt_id in running:
        (rt.running_executor(prompt_id) or rt.executor).interrupt()
    else:
        log.debug("prompt not running, skipping interrupt", prompt_id=prompt_id)
    return web.Response(status=200)


@routes.post("/free")
async def post_free(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    try:
        body = await json_body(request)
        unload_models = bool(body.get("unload_models", False))
        free_memory = bool(body.get("free_memory", False))
    except (ValueError, AttributeError):
        return server_error()
    rt.stats.frees += 1
    log.info("free requested", unload_models=unload_models, free_memory=free_memory)
    for executor in rt.executors:
        executor.request_free(free_memory)
    return web.Response(status=200)


@api_only_routes.get("/api/jobs")
async def get_jobs(request: web.Request) -> web.Response:
    query = request.rel_url.query
    statuses = list(STATUSES)
    if query.get("status"):
        statuses = [s.strip().lower() for s in query["status"].split(",") if s.strip()]
        invalid = [s for s in statuses if s not in STATUSES]
        if invalid:
            return _bad(
                f"Invalid status value(s): {', '.join(invalid)}. "
                f"Valid values: {', '.join(STATUSES)}"
            )
    sort_by = query.get("sort_by", "created_at").lower()
    sort_order = query.get("sort_order", "desc").lower()
    if sort_by not in ("created_at", "execution_duration"):
        return _bad("sort_by must be 'created_at' or 'execution_duration'")
    if sort_order not in ("asc", "desc"):
        return _bad("sort_order must be 'asc' or 'desc'")
    limit: int | None = None
    if "limit" in query:
        try:
            limit = int(query["limit"])
        except ValueError:
            return _bad("limit must be an integer")
        if limit <= 0:
            return _bad("limit must be a positive integer")
    offset = 0
    if "offset" in query:
        try:
            offset = max(int(query["offset"]), 0)
        except ValueError:
            return _bad("offset must be an integer")
    queue = runtime_of(request).queue
    running, pending = queue.volatile()
    jobs, total = get_all_jobs(
        running,
        pending,
        queue.history,
        statuses,
        query.get("workflow_id"),
        sort_by,
        sort_order,
        limit,
        offset,
    )
    pagination = {
        "offset": offset,
        "limit": limit,
        "total": total,
        "has_more": offset + len(jobs) < total,
    }
    return web.json_response({"jobs": jobs, "pagination": pagination})


def _bad(error: str) -> web.Response:
    return web.json_response({"error": error}, status=400)


@api_only_routes.get("/api/jobs/{job_id}")
async def get_job_by_id(request: web.Request) -> web.Response:
    queue = runtime_of(request).queue
    job_id = request.match_info["job_id"]
    running, pending = queue.volatile()
    job = get_job(job_id, running, pending, queue.get_history(prompt_id=job_id))
    if job is None:
        return web.json_response({"error": "Job not found"}, status=404)
    return web.json_response(job)


def _memory() -> tuple[int, int]:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return total, free
    except (ValueError, OSError, AttributeError):
        return 16 * 1024**3, 8 * 1024**3


@routes.get("/system_stats")
async def system_stats(request: web.Request) -> web.Response:
    ram_total, ram_free = _memory()
    stats: dict[str, Any] = {
        "system": {
            "os": sys.platform,
            "ram_total": ram_total,
            "ram_free": ram_free,
            "comfyui_version": SIM_VERSION,
            "python_version": sys.version,
            "pytorch_version": "none (simulated)",
            "embedded_python": False,
            "argv": sys.argv,
        },
        "devices": [
            {
                "name": "cpu (simulated by durable-comfy)",
                "type": "cpu",
                "index": None,
                "vram_total": ram_total,
                "vram_free": ram_free,
                "torch_vram_total": 0,
                "torch_vram_free": 0,
            }
        ],
    }
    return web.json_response(stats)


@routes.get("/features")
async def features(request: web.Request) -> web.Response:
    max_upload = runtime_of(request).settings.max_upload_bytes
    return web.json_response({"supports_preview_metadata": False, "max_upload_size": max_upload})


@routes.get("/object_info")
async def object_info(request: web.Request) -> web.Response:
    settings = runtime_of(request).settings
    return web.json_response({name: node_info(spec, settings) for name, spec in REGISTRY.items()})


@routes.get("/object_info/{node_class}")
async def object_info_node(request: web.Request) -> web.Response:
    spec = REGISTRY.get(request.match_info["node_class"])
    if spec is None:
        return web.json_response({})
    return web.json_response({spec.name: node_info(spec, runtime_of(request).settings)})


@routes.get("/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    return web.json_response([])


@routes.get("/models")
async def model_types(request: web.Request) -> web.Response:
    return web.json_response(["checkpoints"])


@routes.get("/models/{folder}")
async def models(request: web.Request) -> web.Response:
    if request.match_info["folder"] != "checkpoints":
        return web.Response(status=404)
    return web.json_response(list(runtime_of(request).settings.checkpoints))
