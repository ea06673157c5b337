"""An aiohttp app served on loopback for a test: a stand-in for ComfyUI's own server (aiohttp
too) or a webhook receiver."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[int]:
    """Serve `app` on 127.0.0.1 at a port the system picks; yields the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
