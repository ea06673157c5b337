"""The simulator's side of a timing: when it sent each progress event (GET /sim/progress), and
when a plain socket of our own received it (the direct script's view of the same progress)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from types import TracebackType
from typing import Self

import httpx
import websockets
from pydantic import BaseModel


class SimProgress(BaseModel):
    node: str
    value: float
    max: float
    at: float  # epoch seconds: when the simulator queued the event for the sockets


async def progress_times(http: httpx.AsyncClient, url: str, prompt_id: str) -> list[SimProgress]:
    response = await http.get(f"{url}/sim/progress", params={"prompt_id": prompt_id})
    response.raise_for_status()
    return [SimProgress.model_validate(e) for e in response.json()["events"]]


class ObserverSocket:
    """A socket of its own on the simulator: `progress_state` is broadcast to every socket, so
    this sees each step as a client talking to ComfyUI directly would, and notes when."""

    def __init__(self, url: str) -> None:
        base = url.rstrip("/").replace("http://", "ws://")
        self.ws_url = f"{base}/ws?clientId=bench-observer-{uuid.uuid4().hex[:8]}"
        # (prompt_id, node, value) -> epoch seconds it first arrived
        self.received: dict[tuple[str, str, int], float] = {}
        self._task: asyncio.Task[None] | None = None
        self._open = asyncio.Event()

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self._open.wait(), timeout=10)
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        async with websockets.connect(self.ws_url, max_size=None) as ws:
            self._open.set()
            async for frame in ws:
                if isinstance(frame, str):
                    self._on_frame(frame, time.time())

    def _on_frame(self, frame: str, now: float) -> None:
        message = json.loads(frame)
        if message.get("type") != "progress_state":
            return
        data = message.get("data") or {}
        prompt_id = str(data.get("prompt_id"))
        for node_id, entry in (data.get("nodes") or {}).items():
            value = entry.get("value") if isinstance(entry, dict) else None
            if isinstance(value, int | float) and entry.get("state") == "running":
                self.received.setdefault((prompt_id, str(node_id), int(value)), now)
