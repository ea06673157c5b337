"""Driving and observing the ComfyUI simulator from a test: counters, queue, live steps (its
faults are armed through inject.py).

The fault timing must not depend on the system under test: "kill the worker at step 8" is decided
by watching the simulator itself (its broadcast `progress_state` events on a socket of our own),
not by the job's status, whose progress signals are throttled and might be the very thing broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Collection
from types import TracebackType
from typing import Self

import httpx
import websockets
from pydantic import BaseModel, Field

from faults.wait import eventually


class SimStats(BaseModel):
    """GET /sim/stats: what the simulator saw since it started or was reset."""

    prompts: dict[str, int] = Field(default_factory=dict)  # accepted POST /prompt per prompt_id
    rejected: int = 0
    interrupts: list[str | None] = Field(default_factory=list)
    interrupted: list[str] = Field(default_factory=list)
    frees: int = 0
    executed: dict[str, str] = Field(default_factory=dict)
    executions: dict[str, int] = Field(default_factory=dict)
    ws_connections: int = 0
    ws_open: int = 0
    # Epoch seconds per prompt_id of its latest run: entered / left the running queue (success,
    # error or interrupted). No `ended_at` for a started prompt: it is still running.
    started_at: dict[str, float] = Field(default_factory=dict)
    ended_at: dict[str, float] = Field(default_factory=dict)


class SimQueue(BaseModel):
    running: list[str]
    pending: list[str]

    @property
    def empty(self) -> bool:
        return not self.running and not self.pending


class SimControl:
    """The simulator's HTTP side: /sim/* plus the two ComfyUI routes a test needs."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self.http = http

    async def stats(self) -> SimStats:
        response = await self.http.get(f"{self.url}/sim/stats", timeout=5.0)
        response.raise_for_status()
        return SimStats.model_validate(response.json())

    async def reset(self) -> None:
        """Counters and faults back to zero; queue, history and files stay."""
        response = await self.http.post(f"{self.url}/sim/reset", timeout=5.0)
        response.raise_for_status()

    async def queue(self) -> SimQueue:
        response = await self.http.get(f"{self.url}/queue", timeout=5.0)
        response.raise_for_status()
        data = response.json()
        return SimQueue(
            running=[str(item[1]) for item in data.get("queue_running", [])],
            pending=[str(item[1]) for item in data.get("queue_pending", [])],
        )

    async def wait_running(self, *, timeout_s: float = 30.0) -> str:
        """The prompt_id of the prompt that is (or becomes) the running one."""

        async def running() -> str | None:
            queue = await self.queue()
            return queue.running[0] if queue.running else None

        prompt_id = await eventually(running, timeout_s=timeout_s, what="a prompt is running")
        assert prompt_id is not None
        return prompt_id

    async def wait_idle(self, *, timeout_s: float = 15.0) -> SimQueue:
        """Nothing queued or running on the backend (teardown interrupts are cooperative)."""
        return await eventually(
            self.queue,
            timeout_s=timeout_s,
            what="the simulator's queue is empty",
            accept=lambda q: q.empty,
        )

    async def clear(self) -> None:
        """Best-effort: drop pending prompts and interrupt the running one (test cleanup only)."""
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(f"{self.url}/queue", json={"clear": True}, timeout=5.0)
            await self.http.post(f"{self.url}/interrupt", json={}, timeout=5.0)


class StepWatcher:
    """Follows every prompt's steps on an observer socket of its own (fresh clientId).

    The simulator broadcasts `progress_state` to every socket, like ComfyUI's progress handler,
    so this sees the sampler's step without touching the job's own socket (whose routing is keyed
    by the job's clientId). It reconnects on its own when the simulator restarts.
    """

    def __init__(self, url: str) -> None:
        base = url.rstrip("/").replace("https://", "wss://").replace("http://", "ws://")
        self.ws_url = f"{base}/ws?clientId=chaos-observer-{uuid.uuid4().hex[:8]}"
        # prompt_id -> node_id -> highest value seen (the step, for a sampler node)
        self.steps: dict[str, dict[str, int]] = {}
        self.order: list[str] = []  # prompt_ids in the order they were first seen
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._run(), name="chaos-step-watcher")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def step(self, prompt_id: str, node: str) -> int:
        return self.steps.get(prompt_id, {}).get(node, 0)

    async def wait_step(
        self,
        step: int,
        *,
        node: str,
        exclude: Collection[str] = (),
        timeout_s: float = 30.0,
    ) -> str:
        """Wait until some prompt (not in `exclude`) has reached `step` on `node`; its ID."""

        async def reached() -> str | None:
            for prompt_id in self.order:
                if prompt_id not in exclude and self.step(prompt_id, node) >= step:
                    return prompt_id
            return None

        found = await eventually(
            reached, timeout_s=timeout_s, what=f"a prompt reaches step {step} of node {node}"
        )
        assert found is not None
        return found

    async def _run(self) -> None:
        while True:
            try:
                async with websockets.connect(self.ws_url, open_timeout=5) as ws:
                    async for frame in ws:
                        if isinstance(frame, str):
                            self._on_message(frame)
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException):
                pass  # the simulator is down on purpose: try again shortly
            await asyncio.sleep(0.1)

    def _on_message(self, frame: str) -> None:
        try:
            message = json.loads(frame)
        except ValueError:
            return
        if not isinstance(message, dict) or message.get("type") != "progress_state":
            return
        data = message.get("data") or {}
        prompt_id = data.get("prompt_id")
        if not isinstance(prompt_id, str):
            return
        if prompt_id not in self.steps:
            self.steps[prompt_id] = {}
            self.order.append(prompt_id)
        seen = self.steps[prompt_id]
        for node_id, entry in (data.get("nodes") or {}).items():
            value = entry.get("value") if isinstance(entry, dict) else None
            if isinstance(value, int | float):
                seen[str(node_id)] = max(seen.get(str(node_id), 0), int(value))
