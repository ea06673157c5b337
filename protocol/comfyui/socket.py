"""A ComfyUI WebSocket that closes promptly, whatever the server still sends.

websockets stops reading a connection once `max_queue` frames (16) wait unread, until some are
read. A follower stops reading when its prompt has ended, while ComfyUI may still be sending:
`status` to every socket whenever its queue changes (many times a second on a busy server; the
simulator's parallel mode does it for every prompt it starts or ends), a custom node's
broadcasts. Once 16 of those wait, ComfyUI's answer to our close frame waits behind them and
the close takes websockets' whole `close_timeout` (10 s), on the job's critical path (the
bench's direct script, which closed the same way, had 5 to 24 of 200 closes take 10 s in a
throughput round). So the close reads, and drops, what arrives meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection


async def close_reading(ws: ClientConnection) -> None:
    """Close `ws`, reading and dropping what arrives until the server's close frame."""

    async def drop_the_rest() -> None:
        # Best effort: the socket may be closing already, or the server may drop it.
        with contextlib.suppress(Exception):
            async for _ in ws:
                pass

    reader = asyncio.create_task(drop_the_rest(), name="ws-close-reader")
    try:
        await ws.close()
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


@contextlib.asynccontextmanager
async def comfy_socket(url: str, **options: Any) -> AsyncIterator[ClientConnection]:
    """`websockets.connect(url, **options)`, closed with `close_reading` however the block
    ends."""
    async with websockets.connect(url, **options) as ws:
        try:
            yield ws
        finally:
            await close_reading(ws)
