"""The aiohttp application: ComfyUI's middlewares and routes (each also under /api), the
WebSocket endpoint, and the background tasks (queue worker, event publisher)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlparse, urlsplit

import structlog
from aiohttp import WSCloseCode, WSMsgType, web

from . import routes_api, routes_files, routes_front, routes_sim
from .hub import Session
from .runtime import RUNTIME, build_runtime, runtime_of
from .settings import SIM_VERSION, SimSettings

log = structlog.get_logger("comfy_sim.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SOCKETS: web.AppKey[set[web.WebSocketResponse]] = web.AppKey("comfy_sim_sockets")


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    loopback = False
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            for *_, sockaddr in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM):
                if not ipaddress.ip_address(sockaddr[0]).is_loopback:
                    return loopback
                loopback = True
        except socket.gaierror:
            pass
    return loopback


@web.middleware
async def origin_only(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ComfyUI's origin_only_middleware: a page on another site must not drive a local server.
    If Host is loopback and Origin's host (and port, when both carry one) differ: 403."""
    if "Host" in request.headers and "Origin" in request.headers:
        host_domain = request.headers["Host"].lower()
        parsed = urlparse(request.headers["Origin"])
        origin_domain: str | None = parsed.netloc.lower()
        host_parsed = urlsplit("//" + host_domain)
        loopback = _is_loopback(host_parsed.hostname)
        compare_host: str | None = host_domain
        if parsed.port is None:
            compare_host = host_parsed.hostname
        if host_parsed.port is None:
            origin_domain = parsed.hostname
        if loopback and compare_host and origin_domain and compare_host != origin_domain:
            log.warning(
                "request with non matching host and origin, returning 403",
                host=compare_host,
                origin=origin_domain,
            )
            return web.Response(status=403)
    if request.method == "OPTIONS":
        return web.Response()
    return await handler(request)


async def websocket(request: web.Request) -> web.WebSocketResponse:
    rt = runtime_of(request)
    ws = web.WebSocketResponse(timeout=2.0)  # close handshake wait: keep shutdown quick
    await ws.prepare(request)
    sid = request.rel_url.query.get("clientId", "")
    if sid:
        rt.hub.sessions.pop(sid, None)  # reusing a session: the newest socket takes over
    else:
        sid = uuid.uuid4().hex
    session = Session(sid, ws, request.transport)
    rt.hub.sessions[sid] = session
    rt.stats.ws_connections += 1
    request.app[SOCKETS].add(ws)
    try:
        await rt.hub.send_now(session, "status", {"status": rt.queue.queue_info(), "sid": sid})
        for executor in rt.executors:
            if executor.client_id == sid and executor.last_node_id is not None:
                await rt.hub.send_now(session, "executing", {"node": executor.last_node_id})
        first = True
        async for msg in ws:
            if msg.type == WSMsgType.TEXT and first:
                with contextlib.suppress(ValueError, AttributeError):
                    data = json.loads(msg.data)
                    if data.get("type") == "feature_flags":
                        features = {
                            "supports_preview_metadata": False,
                            "max_upload_size": rt.settings.max_upload_bytes,
                        }
                        await rt.hub.send_now(session, "feature_flags", features)
            first = False
    finally:
        # As in ComfyUI: unconditional, so closing a superseded socket unregisters the ID.
        rt.hub.sessions.pop(sid, None)
        request.app[SOCKETS].discard(ws)
    return ws


async def _background(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    for folder in (rt.settings.output_dir, rt.settings.input_dir, rt.settings.temp_path):
        folder.mkdir(parents=True, exist_ok=True)
    tasks = [
        asyncio.create_task(rt.hub.publish_forever(), name="comfy-sim-publisher"),
        *(
            asyncio.create_task(executor.run_forever(), name=f"comfy-sim-worker-{number}")
            for number, executor in enumerate(rt.executors)
        ),
    ]
    log.info(
        "ComfyUI simulator ready",
        version=SIM_VERSION,
        output_dir=str(rt.settings.output_dir),
        parallel=rt.settings.parallel,
    )
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _close_sockets(app: web.Application) -> None:
    sockets = app[SOCKETS]
    for ws in list(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")


def create_app(settings: SimSettings | None = None) -> web.Application:
    """The simulator as an aiohttp Application (for in-process tests or web.run_app)."""
    settings = (settings or SimSettings()).resolved()
    app = web.Application(client_max_size=settings.max_upload_bytes, middlewares=[origin_only])
    app[RUNTIME] = build_runtime(settings)
    sockets: set[web.WebSocketResponse] = set()
    app[SOCKETS] = sockets
    table = web.RouteTableDef()
    table.get("/ws")(websocket)
    for source in (table, routes_front.routes, routes_api.routes, routes_files.routes):
        for route in source:
            assert isinstance(route, web.RouteDef)
            # Registered as ComfyUI's route table registers them: a GET also answers HEAD.
            for path in (route.path, "/api" + route.path):
                web.RouteDef(route.method, path, route.handler, route.kwargs).register(app.router)
    app.add_routes(routes_api.api_only_routes)
    app.add_routes(routes_sim.routes)
    app.cleanup_ctx.append(_background)
    app.on_shutdown.append(_close_sockets)
    return app
