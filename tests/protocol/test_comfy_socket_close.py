"""A follower's socket closes at once when its prompt has ended, even while ComfyUI goes on
sending (protocol/comfyui/socket.py): websockets stops reading after 16 unread frames, and
the server's close frame then waited behind them for the whole close timeout."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import websockets
from aiohttp import web

from protocol.comfyui.socket import comfy_socket
from tests.support.aiohttp_servers import served

CHATTER = 200  # `status` frames the server sends after the prompt's end (16 fill the queue)


@asynccontextmanager
async def chatty_server() -> AsyncIterator[str]:
    """An aiohttp socket, as ComfyUI's: the end of the prompt, then broadcasts nobody reads."""

    async def socket(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(json.dumps({"type": "executing", "data": {"node": None}}))
        for n in range(CHATTER):
            await ws.send_str(json.dumps({"type": "status", "data": {"n": n}}))
        async for _ in ws:
            pass
        return ws

    app = web.Application()
    app.router.add_get("/ws", socket)
    async with served(app) as port:
        yield f"ws://127.0.0.1:{port}/ws"


async def test_the_socket_closes_at_once_though_the_server_goes_on_sending() -> None:
    async with chatty_server() as url:
        # A close timeout far above the test's bound: a close that waits for it fails the test.
        async with asyncio.timeout(5):
            async with comfy_socket(url, close_timeout=8) as ws:
                assert "executing" in str(await ws.recv())
                await asyncio.sleep(0.3)  # the chatter arrives, unread: reading stops at 16
            assert ws.close_code == 1000, "the server's close frame was read"


async def test_without_it_the_close_waits_for_the_timeout() -> None:
    """The same with websockets' own close: why the module exists (if websockets ever drops
    what arrives while it closes, this fails and the module can go)."""
    async with chatty_server() as url:
        ws = await websockets.connect(url, close_timeout=1.5)
        assert "executing" in str(await ws.recv())
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await ws.close()
        assert loop.time() - began >= 1.4 and ws.close_code != 1000
