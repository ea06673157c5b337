"""A webhook receiver on 127.0.0.1 for the tests: it checks each request's Standard Webhooks
signature with its own implementation of the scheme (not the worker's), records every attempt,
answers what the test says (200, or 503 for a while), and can be stopped and started again on
the same port (a receiver that is down refuses connections).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from tests.conftest import HOST, free_port


@dataclass
class Received:
    """One request as the receiver saw it, and what it answered."""

    webhook_id: str
    timestamp: str
    signature_valid: bool
    body: dict[str, Any]
    answered: int
    path: str

    @property
    def type(self) -> str:
        return str(self.body.get("type"))


# Standard Webhooks' own published test vector (its spec's example secret, id, timestamp and
# body): public on purpose, used only to show our signature is theirs. Every other test signs
# with a fresh secret of its own (`signing_secret`).
SPEC_VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def signing_secret(name: str) -> str:
    """A signing secret shaped as an operator's (`whsec_` + base64 of 24 bytes), made from
    `name`: the same in every pytest-xdist process (parametrized ids hold it), and plainly no
    one's credential."""
    return "whsec_" + base64.b64encode(hashlib.sha256(name.encode()).digest()[:24]).decode()


def expected_signature(secret: str, webhook_id: str, timestamp: str, body: bytes) -> str:
    """Standard Webhooks, written from its spec: base64(HMAC-SHA256(key, id.timestamp.body))."""
    key = base64.b64decode(secret.split("_", 1)[1])
    content = webhook_id.encode() + b"." + timestamp.encode() + b"." + body
    return base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode()


def signature_valid(secret: str, headers: dict[str, str], body: bytes) -> bool:
    wanted = expected_signature(
        secret, headers.get("webhook-id", ""), headers.get("webhook-timestamp", ""), body
    )
    # The header may hold several space-separated signatures, each `v1,<base64>`.
    offered = [item.split(",", 1) for item in headers.get("webhook-signature", "").split()]
    return any(
        len(pair) == 2 and pair[0] == "v1" and hmac.compare_digest(pair[1], wanted)
        for pair in offered
    )


@dataclass
class WebhookReceiver:
    secret: str
    port: int = field(default_factory=free_port)
    # The status every request gets while set; None: 200.
    answer: int | None = None
    received: list[Received] = field(default_factory=list)
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/hooks/jobs?token=query-secret"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, self.port, reuse_address=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def delivered(self) -> list[Received]:
        """The requests answered 2xx, in arrival order."""
        return [r for r in self.received if 200 <= r.answered < 300]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode("latin-1").split()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            status = self.answer or 200
            self.received.append(
                Received(
                    webhook_id=headers.get("webhook-id", ""),
                    timestamp=headers.get("webhook-timestamp", ""),
                    signature_valid=signature_valid(self.secret, headers, body),
                    body=json.loads(body),
                    answered=status,
                    path=request_line[1] if len(request_line) > 1 else "",
                )
            )
            writer.write(
                f"HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
            )
            await writer.drain()
        finally:
            writer.close()
