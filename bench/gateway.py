"""The HTTP gateway as a benchmark runs it: a process of its own, and a client of its streams."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.stack import ROOT, BenchContext
from devstack.free_ports import free_port
from devstack.processes import PidRecord, is_alive, log_tail, spawn_detached, terminate


@dataclass(frozen=True)
class GatewayProcess:
    url: str
    record: PidRecord
    log_file: Path

    @property
    def pid(self) -> int:
        return self.record.pid


@asynccontextmanager
async def extra_gateway(
    ctx: BenchContext, name: str, task_queue: str, env: dict[str, str] | None = None
) -> AsyncIterator[GatewayProcess]:
    """`durable-comfy gateway` on 127.0.0.1 (open: no keys, tenant `local`) in front of
    `task_queue`'s worker, stopped by PID when the block ends."""
    port = free_port()
    argv = [sys.executable, "-m", "starter.cli", "gateway", "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    environment = {
        **ctx.stack.worker_env(),
        "DURABLE_COMFY_TASK_QUEUE": task_queue,
        "DURABLE_COMFY_LOG_LEVEL": "WARNING",
        # The benchmark measures the gateway's work, not its per-tenant limits: one tenant
        # (`local`) opens a thousand streams and submits a hundred jobs at once.
        "DURABLE_COMFY_TENANT_RPS": "100000",
        "DURABLE_COMFY_TENANT_BURST": "100000",
        "DURABLE_COMFY_TENANT_MAX_JOBS": "100000",
        **(env or {}),
    }
    log_file = ctx.work_dir / "logs" / f"gateway-{name}.log"
    pid_file = ctx.work_dir / "pids" / f"gateway-{name}.pid"
    record = spawn_detached(argv, log_file, ROOT, pid_file, env=environment)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if (await ctx.http.get(f"{url}/readyz", timeout=2)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if not is_alive(record) or time.monotonic() > deadline:
                raise RuntimeError(f"gateway {name} did not start:\n{log_tail(log_file)}")
            await asyncio.sleep(0.1)
        yield GatewayProcess(url, record, log_file)
    finally:
        await terminate(record, grace_s=10)


@dataclass(frozen=True)
class SseEvent:
    event: str
    id: str | None
    data: dict[str, Any]
    at: float  # epoch seconds, when the event's blank line arrived


async def sse_events(
    http: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> AsyncIterator[SseEvent]:
    """The events of one Server-Sent Events stream as they arrive (comments skipped)."""
    async with http.stream("GET", url, headers=headers, timeout=None) as response:
        response.raise_for_status()
        event, event_id = "message", None
        data: list[str] = []
        async for line in response.aiter_lines():
            if line == "":
                if data:
                    yield SseEvent(event, event_id, json.loads("\n".join(data)), time.time())
                event, data = "message", []
            elif line.startswith(":"):
                continue
            else:
                field, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if field == "event":
                    event = value
                elif field == "id":
                    event_id = value
                elif field == "data":
                    data.append(value)
