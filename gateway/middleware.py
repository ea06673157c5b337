"""What wraps every request: a bounded body, and one log line without secrets.

The body bound is checked twice: a `Content-Length` over it is refused before anything is
read, and a body sent without one (chunked) is counted as it arrives and refused the moment it
passes the bound, so no request makes the gateway hold more than the bound in memory.

The log line has the path without its query string and never a header: an Authorization
header, a key or a presigned URL's signature never reaches the logs.
"""

from __future__ import annotations

import re
import time
from typing import Any

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import BodyTooLarge

log = structlog.get_logger("gateway.http")

_JOB_PATH = re.compile(r"^/v1/jobs/([^/]+)")
_BATCH_PATH = re.compile(r"^/v1/batches/([^/]+)")


class BoundedBodies:
    """Refuses bodies over `limit` bytes with 413, before reading them or as they arrive."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await BodyTooLarge(self.limit, scope["path"]).response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit, scope["path"])
            return message

        await self.app(scope, counted, send)


class RequestLog:
    """One `request` line per HTTP request (method, path, status, time); never a query string
    or a header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: dict[str, Any] = {"code": None}

        async def noted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        path: str = scope["path"]
        fields: dict[str, Any] = {"method": scope.get("method", "WS"), "path": path}
        if found := _JOB_PATH.match(path):
            fields["job_id"] = found.group(1)
        elif found := _BATCH_PATH.match(path):
            fields["batch_id"] = found.group(1)
        try:
            await self.app(scope, receive, noted)
        finally:
            ms = round((time.monotonic() - started) * 1000, 1)
            log.info("request", status=status["code"], ms=ms, **fields)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return None
