"""The simulator's moving parts, wired together once per aiohttp application."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .executor import Executor
from .faults import FaultState
from .hub import Hub
from .settings import SimSettings
from .state import PromptQueue, SimStats


@dataclass
class SimRuntime:
    settings: SimSettings
    queue: PromptQueue
    hub: Hub
    faults: FaultState
    stats: SimStats
    executor: Executor
    number: int = 0  # PromptServer.number: the next queue number handed out


RUNTIME = web.AppKey("comfy_sim_runtime", SimRuntime)


def build_runtime(settings: SimSettings) -> SimRuntime:
    hub = Hub()
    holder: list[PromptQueue] = []

    def queue_updated() -> None:
        # server.queue_updated(): every queue change broadcasts the remaining count.
        hub.send_sync("status", {"status": holder[0].queue_info()})

    queue = PromptQueue(queue_updated)
    holder.append(queue)
    faults, stats = FaultState(), SimStats()
    executor = Executor(settings, queue, hub, faults, stats)
    return SimRuntime(settings, queue, hub, faults, stats, executor)


def runtime_of(request: web.Request) -> SimRuntime:
    return request.app[RUNTIME]


async def json_body(request: web.Request) -> Any:
    """request.json(); ComfyUI lets a bad body raise, which aiohttp turns into a 500."""
    return json.loads(await request.text())


def server_error() -> web.Response:
    """What aiohttp answers when a ComfyUI handler raises (e.g. /free or /prompt without body)."""
    return web.Response(
        status=500, text="500 Internal Server Error\n\nServer got itself in trouble"
    )
