"""Simulator-only endpoints under /sim/ (not part of ComfyUI): counters, fault injection, and
when each progress event was sent (for `make bench`)."""

from __future__ import annotations

from aiohttp import web
from pydantic import ValidationError

from .faults import FaultConfig
from .runtime import json_body, runtime_of

routes = web.RouteTableDef()


@routes.get("/sim/stats")
async def sim_stats(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    return web.json_response(rt.stats.as_json(ws_open=len(rt.hub.sessions)))


@routes.get("/sim/progress")
async def sim_progress(request: web.Request) -> web.Response:
    """?prompt_id=ID: when each `progress` event of the prompt's latest run was queued for the
    sockets, as {"prompt_id", "events": [{"node", "value", "max", "at"}]} with `at` in epoch
    seconds. The last 32 prompts are kept; an unknown one has no events."""
    rt = runtime_of(request)
    prompt_id = request.query.get("prompt_id", "")
    events = [
        {"node": node, "value": value, "max": maximum, "at": at}
        for node, value, maximum, at in rt.stats.progress.get(prompt_id, [])
    ]
    return web.json_response({"prompt_id": prompt_id, "events": events})


@routes.get("/sim/faults")
async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(runtime_of(request).faults.as_json())


@routes.post("/sim/faults")
async def post_faults(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    try:
        update = FaultConfig.model_validate(await json_body(request))
    except (ValueError, ValidationError) as exc:
        return web.json_response({"error": str(exc)}, status=400)
    rt.faults.arm(update)
    return web.json_response(rt.faults.as_json())


@routes.post("/sim/reset")
async def reset(request: web.Request) -> web.Response:
    """Clear counters and faults (queue, history and files are left alone)."""
    rt = runtime_of(request)
    rt.stats.reset()
    rt.faults.reset()
    rt.hub.reset_faults()
    return web.json_response({"ok": True})
