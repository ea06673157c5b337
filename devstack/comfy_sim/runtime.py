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
    # One per prompt that may run at once (SimSettings.parallel; 1 is ComfyUI). `executor` is the
    # first: the only one unless the simulator runs in parallel mode.
    executors: list[Executor]
    number: int = 0  # PromptServer.number: the next queue number handed out

    @property
    def executor(self) -> Executor:
        return self.executors[0]

    def running_executor(self, prompt_id: str) -> Executor | None:
        return next((e for e in self.executors if e.running_prompt_id == prompt_id), None)


RUNTIME = web.AppKey("comfy_sim_runtime", SimRuntime)


def build_runtime(settings: SimSettings) -> SimRuntime:
    hub = Hub()
    holder: list[PromptQueue] = []

    def queue_updated() -> None:
        # server.queue_updated(): every queue change broadcasts the remaining count.
        hub.send_sync("status", {"status": holder[0].queue_info()})

    queue = PromptQueue(queue_updated)
    holder.append(queue)
    faults, stats = FaultState(), SimStats(progress_log_prompts=settings.progress_log_prompts)
    executors = [Executor(settings, queue, hub, faults, stats) for _ in range(settings.parallel)]
    return SimRuntime(settings, queue, hub, faults, stats, executors)


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
