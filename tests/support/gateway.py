"""The gateway as its tests run it: uvicorn in this process on a free 127.0.0.1 port, in front
of a worker of the local stack, with keys for two tenants; and plain clients of its streams."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from configuration.settings import GatewaySettings
from devstack.free_ports import free_port
from devstack.models import RunningStack
from gateway.app import create_app
from gateway.feed import Hub
from gateway.state import Gateway
from starter import JobClient
from tests.support.cli import RunningWorker, example, s3_settings

KEYS = {
    "acme": "acme-" + uuid.uuid4().hex,
    "beta": "beta-" + uuid.uuid4().hex,
    "gamma": "gamma-" + uuid.uuid4().hex,
    # A tenant of one test's own (a thousand jobs in a batch): the namespace keeps their
    # record, which another tenant's list would otherwise hold.
    "delta": "delta-" + uuid.uuid4().hex,
}
# Short enough that a test sees a follower leave and an attached job noticed.
TEST_SETTINGS = {
    "DURABLE_COMFY_GATEWAY_HEARTBEAT_S": 1.0,
    "DURABLE_COMFY_GATEWAY_FOLLOWER_GRACE_S": 0.5,
    "DURABLE_COMFY_GATEWAY_CLIENT_SEEN_S": 1.0,
    "DURABLE_COMFY_GATEWAY_POLL_S": 0.2,
    "DURABLE_COMFY_GATEWAY_MAX_BODY_BYTES": 64 * 1024,
    "DURABLE_COMFY_TENANT_RPS": 1000.0,
    "DURABLE_COMFY_TENANT_BURST": 1000,
}


@dataclass
class RunningGateway:
    url: str
    app: FastAPI

    @property
    def state(self) -> Gateway:
        gateway: Gateway = self.app.state.gateway
        return gateway

    @property
    def hub(self) -> Hub:
        return self.state.hub

    @staticmethod
    def auth(tenant: str = "acme") -> dict[str, str]:
        return {"Authorization": f"Bearer {KEYS[tenant]}"}


@asynccontextmanager
async def running_gateway(
    factory: Callable[[], Awaitable[JobClient]], *, wait_ready: bool = True
) -> AsyncIterator[RunningGateway]:
    """The gateway with the tenants of `KEYS` on a free port, stopped on the way out."""
    keys = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())
    settings = GatewaySettings(**{"DURABLE_COMFY_API_KEYS": keys, **TEST_SETTINGS})  # type: ignore[arg-type]
    async with serving_app(settings, factory, wait_ready=wait_ready) as running:
        yield running


@asynccontextmanager
async def serving_app(
    settings: GatewaySettings,
    factory: Callable[[], Awaitable[JobClient]],
    *,
    wait_ready: bool = True,
) -> AsyncIterator[RunningGateway]:
    """uvicorn serving `create_app(settings)` on a free port, stopped on the way out."""
    app = create_app(settings, factory)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            for _ in range(300):
                if task.done():
                    task.result()
                try:
                    answer = await http.get(f"{url}/readyz")
                    if answer.status_code == 200 or (not wait_ready and server.started):
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("the gateway did not get ready")
        yield RunningGateway(url, app)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=30)


def stack_client_factory(
    stack: RunningStack, worker: RunningWorker
) -> Callable[[], Awaitable[JobClient]]:
    async def connect() -> JobClient:
        return await JobClient.connect(
            stack.temporal_address,
            stack.namespace,
            task_queue=worker.task_queue,
            s3=s3_settings(stack),
        )

    return connect


def job_body(steps: int = 8, **extra: Any) -> dict[str, Any]:
    """The example graph with `steps` steps and a fresh seed (never answered from a cache)."""
    graph = example(steps)
    graph["3"]["inputs"]["seed"] = uuid.uuid4().int % 2**32
    return {"graph": graph, "pool": "comfyui", **extra}


@dataclass(frozen=True)
class SseEvent:
    event: str
    id: str | None
    data: dict[str, Any]


async def sse_events(
    http: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> AsyncIterator[SseEvent]:
    """A Server-Sent Events stream, parsed as the spec says (comments and `retry` skipped)."""
    async with http.stream("GET", url, headers=headers, timeout=60) as response:
        if response.status_code != 200:
            await response.aread()
            raise AssertionError(f"{response.status_code}: {response.text}")
        assert response.headers["content-type"].startswith("text/event-stream")
        event, event_id = "message", None
        data: list[str] = []
        async for line in response.aiter_lines():
            if line == "":
                if data:
                    yield SseEvent(event, event_id, json.loads("\n".join(data)))
                event, data = "message", []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "id":
                event_id = value
            elif name == "data":
                data.append(value)


JOURNAL_KINDS = ("state", "output_stored", "progress")
_QUERY = re.compile(r"\?.*$")


def journal_key(data: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies a journal entry, whatever link it was given."""
    artifact = data.get("artifact") or {}
    return (data["seq"], data["kind"], data.get("state"), data.get("percent"), artifact.get("key"))


def without_query_strings(view: dict[str, Any]) -> dict[str, Any]:
    """A job view with its presigned links' query strings cut (they change on every call)."""
    copy: dict[str, Any] = json.loads(json.dumps(view))
    for artifact in copy.get("artifacts", []):
        if artifact.get("url"):
            artifact["url"] = _QUERY.sub("", artifact["url"])
    return copy


async def wait_state(
    http: httpx.AsyncClient, gateway: RunningGateway, job_id: str, tenant: str = "acme"
) -> dict[str, Any]:
    """Polls GET until the job has ended (bounded by the test's own timeout)."""
    while True:
        answer = await http.get(f"{gateway.url}/v1/jobs/{job_id}", headers=gateway.auth(tenant))
        assert answer.status_code == 200, answer.text
        view: dict[str, Any] = answer.json()
        if view.get("terminal") is True:
            return view
        await asyncio.sleep(0.2)
