"""The gateway's ASGI app (docs/http-api.md): `create_app(settings)`, served by `gateway.cli`.

Stateless: every answer comes from the jobs' workflows through one `JobClient`, so any number
of replicas can serve the same jobs. What a replica keeps is only what saves calls: each job's
tenant and links' lifetime (they never change), and one follower per job it streams.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

from configuration.settings import GatewaySettings, TemporalSettings
from gateway import batches_api, jobs_api, pools_api, stream_api, uploads_api, usage_api
from gateway.auth import ApiKeys
from gateway.batches_api import BatchSubmission
from gateway.errors import UNAVAILABLE_RETRY_AFTER_S, install_error_handlers, retry_after
from gateway.jobs_api import JobSubmission
from gateway.middleware import BoundedBodies, RequestLog
from gateway.state import ClientFactory, Gateway, gateway_of
from gateway.uploads import UPLOAD_EXTENSIONS, UploadRequest
from starter.client import JobClient
from workflows.contracts import TERMINAL_STATES

log = structlog.get_logger("gateway")

STATIC = Path(__file__).parent / "static"
EXAMPLE_GRAPH = Path(__file__).parent.parent / "examples" / "txt2img.json"


def default_client_factory(temporal: TemporalSettings | None = None) -> ClientFactory:
    """`JobClient.connect` as the CLI connects: Temporal's variables or profile, the task
    queue, and the bucket when DURABLE_COMFY_BUCKET is set (for presigned links)."""
    settings = temporal or TemporalSettings()

    async def connect() -> JobClient:
        return await JobClient.connect(settings.address, settings.namespace)

    return connect


def create_app(
    settings: GatewaySettings | None = None,
    client_factory: ClientFactory | None = None,
    *,
    keys: ApiKeys | None = None,
) -> FastAPI:
    settings = settings or GatewaySettings()
    gateway = Gateway(
        settings,
        client_factory or default_client_factory(),
        keys or ApiKeys.from_settings(settings),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    app = FastAPI(
        title="durable-comfy gateway",
        summary="Durable ComfyUI jobs over HTTP: submit (alone or in batches), follow (SSE, "
        "WebSocket, polling), cancel, resume, fetch outputs.",
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    install_error_handlers(app)
    app.include_router(jobs_api.router)
    app.include_router(batches_api.router)
    app.include_router(batches_api.events_router)
    app.include_router(pools_api.router)
    app.include_router(usage_api.router)
    app.include_router(stream_api.router)
    app.include_router(uploads_api.router)
    _add_service_routes(app, gateway)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    # The page's files at /, after every API route (a missing folder serves 404s).
    app.mount("/", StaticFiles(directory=STATIC, html=True, check_dir=False), name="page")
    app.add_middleware(BoundedBodies, limit=settings.max_body_bytes)
    app.add_middleware(RequestLog)
    return app


def _add_service_routes(app: FastAPI, gateway: Gateway) -> None:
    example = _example_graph()

    @app.get("/healthz", tags=["service"])
    async def healthz() -> dict[str, str]:
        """200 while the process serves."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["service"])
    async def readyz(request: Request) -> JSONResponse:
        """200 when Temporal answers, 503 with Retry-After when it does not."""
        try:
            client = await gateway_of(request).client()
            await client.temporal.workflow_service.describe_namespace(
                DescribeNamespaceRequest(namespace=client.temporal.namespace),
                timeout=timedelta(seconds=gateway.settings.ready_timeout_s),
            )
        except Exception as exc:
            log.info("not_ready", error=type(exc).__name__)
            return JSONResponse(
                {"error": {"type": "TemporalUnavailable", "message": "Temporal does not answer"}},
                status_code=503,
                headers=retry_after(UNAVAILABLE_RETRY_AFTER_S),
            )
        return JSONResponse({"status": "ready"})

    @app.get("/v1/config", tags=["service"])
    async def config() -> dict[str, Any]:
        """What the browser page needs before it asks for anything: whether a key is
        required, the example graph, the body limit, which input files it may upload, and the
        states a job ends in (for a status written before `terminal` was)."""
        return {
            "auth_required": not gateway.keys.open,
            "example_graph": example,
            "max_body_bytes": gateway.settings.max_body_bytes,
            "uploads": {
                "max_bytes": gateway.settings.upload_max_bytes,
                "types": UPLOAD_EXTENSIONS,
            },
            "terminal_states": sorted(state.value for state in TERMINAL_STATES),
        }


def _example_graph() -> dict[str, Any] | None:
    """The example the page offers (examples/txt2img.json; none in an install without it)."""
    try:
        graph = json.loads(EXAMPLE_GRAPH.read_text())
    except (OSError, ValueError):
        return None
    return graph if isinstance(graph, dict) else None


# The bodies routes read themselves (bounded, their errors in the gateway's shape), which
# FastAPI therefore does not know: each route's requestBody names its schema here.
OWN_BODIES: dict[str, type[BaseModel]] = {
    "JobSubmission": JobSubmission,
    "BatchSubmission": BatchSubmission,
    "UploadRequest": UploadRequest,
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the bodies the routes read themselves."""
    if app.openapi_schema:
        return app.openapi_schema
    document = get_openapi(
        title=app.title, version=app.version, summary=app.summary, routes=app.routes
    )
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for name, model in OWN_BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[name] = schema
    app.openapi_schema = document
    return document
