"""What stands in front of every route: injected bursts, authentication, the endpoint id, rate
limits (public API); the worker key and the worker's identity (worker API)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from .runtime import runtime_of
from .workers import Worker

log = structlog.get_logger("runpod_sim.gate")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
WorkerHandler = Callable[[web.Request, Worker], Awaitable[web.StreamResponse]]


def error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _key_matches(header: str, key: str) -> bool:
    # RunPod takes "Bearer KEY" and, as its own curl examples send it, the bare key.
    return header in (key, f"Bearer {key}")


def public(route: str) -> Callable[[Handler], Handler]:
    """A public API route: bursts first (a gateway answers those), then the API key, the
    endpoint id and the rate limit of the route's bucket."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def gated(request: web.Request) -> web.StreamResponse:
            rt = runtime_of(request)
            burst = rt.faults.take_burst(route)
            if burst == 429:
                return error(429, "rate limit exceeded (simulated burst)", **{"Retry-After": "1"})
            if burst is not None:
                return error(burst, "upstream error (simulated burst)")
            if not _key_matches(request.headers.get("Authorization", ""), rt.settings.api_key):
                return error(401, "Unauthorized")
            if request.match_info.get("endpoint_id") != rt.settings.endpoint_id:
                return error(404, "endpoint not found")
            wait_s = rt.limiter.hit(route)
            if wait_s is not None:
                return error(429, "rate limit exceeded", **{"Retry-After": str(wait_s)})
            return await handler(request)

        return gated

    return decorate


def worker_api(handler: WorkerHandler) -> Handler:
    """A worker-facing route: the SDK sends RUNPOD_AI_API_KEY as the bare Authorization header;
    the worker id is in the path."""

    @functools.wraps(handler)
    async def gated(request: web.Request) -> web.StreamResponse:
        rt = runtime_of(request)
        if not _key_matches(request.headers.get("Authorization", ""), rt.pool.worker_key):
            # The SDK prefers ~/.runpod/config.toml's api_key over RUNPOD_AI_API_KEY.
            log.warning(
                "worker request with a wrong key (a ~/.runpod/config.toml overrides "
                "RUNPOD_AI_API_KEY in the runpod SDK)",
                path=request.path,
            )
            return error(401, "Unauthorized")
        if request.match_info.get("endpoint_id") != rt.settings.endpoint_id:
            return error(404, "endpoint not found")
        worker = rt.pool.workers.get(request.match_info.get("worker_id", ""))
        if worker is None:
            return error(404, "unknown worker")
        return await handler(request, worker)

    return gated
