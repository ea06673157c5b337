"""The pushed routes: Server-Sent Events and the WebSocket (docs/http-api.md, Events).

Both carry one sequence (`gateway.feed.stream_events`). A stream that cannot go on (the
follower lost Temporal, or this client fell too far behind) ends with an `error` event; the
client reconnects with the last id it saw and misses nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, Header, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.deps import caller
from gateway.errors import Unauthorized, api_error_for, bad_request
from gateway.feed import Cursor, StreamEvent, stream_events
from gateway.state import Gateway, gateway_of

log = structlog.get_logger("gateway.stream")

router = APIRouter(prefix="/v1", tags=["events"])

# SSE: how soon a browser's EventSource reconnects after a drop.
RETRY_MS = 1000


def _cursor(text: str | None, where: str) -> Cursor | None:
    if text is None or text == "":
        return None
    try:
        return Cursor.parse(text)
    except ValueError as exc:
        raise bad_request(f"{where}: {exc}") from None


class HeldStream(StreamingResponse):
    """A streaming response that gives its stream slot back however the stream ends (even one
    whose body never started)."""

    def __init__(
        self, content: AsyncIterator[str], slot: AbstractAsyncContextManager[None], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.slot.__aexit__(None, None, None)


def sse_frame(event: StreamEvent) -> str:
    data = json.dumps(event.data, separators=(",", ":"))
    return f"id: {event.id}\nevent: {event.kind}\ndata: {data}\n\n"


def sse_response(
    events: AsyncIterator[StreamEvent | None],
    slot: AbstractAsyncContextManager[None],
    **about: str,
) -> HeldStream:
    """Server-Sent Events of a job's or a batch's stream (None: a keep-alive); a failure ends
    it with an `error` event, as the JSON error of any route says it. `about` names what the
    stream follows in the log."""

    async def frames() -> AsyncIterator[str]:
        yield f"retry: {RETRY_MS}\n\n"
        try:
            async for event in events:
                yield ": keep-alive\n\n" if event is None else sse_frame(event)
        except Exception as exc:
            error = api_error_for(exc)
            log.info("stream_ended", **about, error=error.error_type)
            yield f"event: error\ndata: {json.dumps(error.body(), separators=(',', ':'))}\n\n"

    return HeldStream(
        frames(),
        slot,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/jobs/{job_id}/events", response_class=StreamingResponse)
async def job_events(
    request: Request,
    job_id: str,
    tenant: Annotated[str, Depends(caller)],
    since: str | None = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    """Server-Sent Events: the replay after `Last-Event-ID` (or `?since=`), then live."""
    gateway = gateway_of(request)
    cursor = _cursor(last_event_id, "Last-Event-ID") or _cursor(since, "since")
    client = await gateway.client()
    await gateway.facts.check_tenant(client, job_id, tenant)
    hub = gateway.hub
    slot = gateway.limits.in_stream()
    await slot.__aenter__()
    heartbeat_s = gateway.settings.heartbeat_s
    events = stream_events(hub, client, job_id, cursor, heartbeat_s)
    return sse_response(events, slot, job_id=job_id)


@router.websocket("/jobs/{job_id}/ws")
async def job_socket(websocket: WebSocket, job_id: str) -> None:
    """The same events as JSON messages `{"event", "id", "data"}`. A client that cannot set
    headers (a browser) sends `{"authorization": "Bearer <key>"}` first."""
    gateway: Gateway = websocket.app.state.gateway
    await websocket.accept()
    try:
        tenant = await _ws_tenant(gateway, websocket)
        gateway.limits.request(tenant)
        cursor = _cursor(websocket.query_params.get("since"), "since")
        async with gateway.limits.in_stream():
            client = await gateway.client()
            await gateway.facts.check_tenant(client, job_id, tenant)
            events = stream_events(
                gateway.hub, client, job_id, cursor, gateway.settings.heartbeat_s
            )

            async def send_all() -> None:
                async for event in events:
                    if event is not None:
                        message = {"event": event.kind, "id": event.id, "data": event.data}
                        await websocket.send_json(message)

            await _until_gone(websocket, send_all)
        await websocket.close(1000)
    except WebSocketDisconnect:
        return
    except Exception as exc:
        error = api_error_for(exc)
        log.info("socket_ended", job_id=job_id, error=error.error_type)
        try:
            await websocket.send_json({"event": "error", "data": error.body()})
            # 4000 + the HTTP status: 4401, 4404, 4429, 4503...
            await websocket.close(4000 + error.status_code)
        except (WebSocketDisconnect, RuntimeError):
            pass


async def _ws_tenant(gateway: Gateway, websocket: WebSocket) -> str:
    header = websocket.headers.get("authorization")
    if header is not None or gateway.keys.open:
        return gateway.keys.tenant_for(header)
    try:
        first = await asyncio.wait_for(
            websocket.receive_json(), timeout=gateway.settings.ws_auth_timeout_s
        )
    except (TimeoutError, ValueError):
        first = None
    if not isinstance(first, dict) or not isinstance(first.get("authorization"), str):
        raise Unauthorized('send {"authorization": "Bearer <key>"} as the first message')
    return gateway.keys.tenant_for(first["authorization"])


async def _until_gone(websocket: WebSocket, send_all: Callable[[], Awaitable[None]]) -> None:
    """Runs `send_all` until it ends or the client goes: the socket is read meanwhile, so a
    client that left is noticed at once, not at the next event."""

    async def read_until_gone() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return

    sender = asyncio.ensure_future(send_all())
    reader = asyncio.ensure_future(read_until_gone())
    try:
        done, _ = await asyncio.wait({sender, reader}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (sender, reader):
            task.cancel()
        await asyncio.gather(sender, reader, return_exceptions=True)
    if sender in done:
        sender.result()
    else:
        raise WebSocketDisconnect(1001)
