"""Simulator-only endpoints under /sim/ (not part of RunPod): readiness, the ledger, faults.
No authentication: they exist for tests and the dev stack on loopback."""

from __future__ import annotations

import json

from aiohttp import web
from pydantic import ValidationError

from .faults import FaultConfig
from .ledger import build_ledger
from .runtime import runtime_of
from .settings import SIM_VERSION

routes = web.RouteTableDef()


@routes.get("/sim/health")
async def sim_health(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    return web.json_response(
        {
            "ok": True,
            "simulator": SIM_VERSION,
            "endpoint_id": rt.settings.endpoint_id,
            "clock_speed": rt.clock.speed,
            "now": round(rt.clock.now(), 3),
            "work_dir": str(rt.work_dir),
        }
    )


@routes.get("/sim/ledger")
async def sim_ledger(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    return web.json_response(
        build_ledger(rt.settings, rt.clock, rt.table, rt.pool, rt.limiter.calls)
    )


@routes.get("/sim/faults")
async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(runtime_of(request).faults.as_json())


@routes.post("/sim/faults")
async def post_faults(request: web.Request) -> web.Response:
    rt = runtime_of(request)
    try:
        update = FaultConfig.model_validate(json.loads(await request.read()))
    except (ValueError, ValidationError) as exc:
        return web.json_response({"error": str(exc)}, status=400)
    rt.faults.arm(update)
    rt.table.changes.notify()  # held job-takes look again (an unhealthy worker healed)
    return web.json_response(rt.faults.as_json())


@routes.post("/sim/reset")
async def reset(request: web.Request) -> web.Response:
    """Disarm every fault (jobs, workers and the ledger are left alone)."""
    rt = runtime_of(request)
    rt.faults.reset()
    rt.table.changes.notify()
    return web.json_response({"ok": True})
