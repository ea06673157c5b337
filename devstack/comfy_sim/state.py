"""The prompt queue and history (ComfyUI's execution.PromptQueue, in memory only) and the
simulator's own counters for /sim/stats."""

from __future__ import annotations

import asyncio
import copy
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

MAXIMUM_HISTORY_SIZE = 10000
# Prompts whose `progress` times GET /sim/progress keeps by default (oldest dropped first): enough
# for a benchmark to read its prompt back, bounded so a long-running simulator does not grow
# (SimSettings.progress_log_prompts, --progress-log-prompts).
PROGRESS_LOG_PROMPTS = 32
SENSITIVE_EXTRA_DATA_KEYS = ("auth_token_comfy_org", "api_key_comfy_org")

# [number, prompt_id, prompt, extra_data, outputs_to_execute], as ComfyUI serialises its tuple.
QueueItem = list[Any]


def public_item(item: QueueItem) -> QueueItem:
    """The item as /queue and /history show it: a deep copy without sensitive extra_data."""
    number, prompt_id, prompt, extra_data, outputs = copy.deepcopy(item)
    extra = {k: v for k, v in extra_data.items() if k not in SENSITIVE_EXTRA_DATA_KEYS}
    return [number, prompt_id, prompt, extra, outputs]


class PromptQueue:
    """A priority queue ordered by `number` (then arrival), one running item at a time.
    `on_change` fires wherever ComfyUI calls server.queue_updated() (a `status` broadcast)."""

    def __init__(self, on_change: Callable[[], None]) -> None:
        self._on_change = on_change
        self._heap: list[tuple[float, int, QueueItem]] = []
        self._arrival = itertools.count()
        self._task_ids = itertools.count()
        self._wakeup = asyncio.Event()
        self.running: dict[int, QueueItem] = {}
        self.history: dict[str, dict[str, Any]] = {}

    def put(self, item: QueueItem) -> None:
        heapq.heappush(self._heap, (float(item[0]), next(self._arrival), item))
        self._wakeup.set()
        self._on_change()

    async def get(self) -> tuple[QueueItem, int]:
        while not self._heap:
            self._wakeup.clear()
            await self._wakeup.wait()
        _, _, item = heapq.heappop(self._heap)
        task_id = next(self._task_ids)
        self.running[task_id] = item
        self._on_change()
        return item, task_id

    def remaining(self) -> int:
        return len(self._heap) + len(self.running)

    def queue_info(self) -> dict[str, Any]:
        return {"exec_info": {"queue_remaining": self.remaining()}}

    def snapshot(self) -> tuple[list[QueueItem], list[QueueItem]]:
        running = [public_item(item) for item in self.running.values()]
        pending = [public_item(item) for _, _, item in sorted(self._heap)]
        return running, pending

    def volatile(self) -> tuple[list[QueueItem], list[QueueItem]]:
        """The items themselves, uncopied and in heap order (ComfyUI's
        get_current_queue_volatile, what its jobs API reads): only for reading."""
        return list(self.running.values()), [item for _, _, item in self._heap]

    def running_prompt_ids(self) -> list[str]:
        return [str(item[1]) for item in self.running.values()]

    def delete(self, prompt_id: Any) -> bool:
        """Remove the first pending item with this ID (only one, as ComfyUI does)."""
        for index, (_, _, item) in enumerate(self._heap):
            if item[1] == prompt_id:
                self._heap.pop(index)
                heapq.heapify(self._heap)
                self._on_change()
                return True
        return False

    def wipe(self) -> None:
        self._heap = []
        self._on_change()

    def task_done(self, task_id: int, result: dict[str, Any], status: dict[str, Any]) -> None:
        item = self.running.pop(task_id)
        if len(self.history) > MAXIMUM_HISTORY_SIZE:
            self.history.pop(next(iter(self.history)))
        entry: dict[str, Any] = {"prompt": public_item(item), "outputs": {}, "status": status}
        entry.update(copy.deepcopy(result))
        self.history[str(item[1])] = entry
        self._on_change()

    def get_history(
        self, prompt_id: str | None = None, max_items: int | None = None, offset: int = -1
    ) -> dict[str, Any]:
        if prompt_id is not None:
            entry = self.history.get(prompt_id)
            return {} if entry is None else {prompt_id: copy.deepcopy(entry)}
        if offset < 0 and max_items is not None:
            offset = len(self.history) - max_items
        out: dict[str, Any] = {}
        for index, (key, entry) in enumerate(self.history.items()):
            if index < offset:
                continue
            out[key] = entry
            if max_items is not None and len(out) >= max_items:
                break
        return copy.deepcopy(out)


@dataclass
class SimStats:
    """What the simulator saw, for tests (GET /sim/stats)."""

    prompts: Counter[str] = field(default_factory=Counter)  # queued (200) per prompt_id
    rejected: int = 0  # 400 answers
    interrupts: list[str | None] = field(default_factory=list)  # requested, None = global
    interrupted: list[str] = field(default_factory=list)  # prompts an interrupt actually hit
    frees: int = 0
    executed: dict[str, str] = field(default_factory=dict)  # success | error | interrupted
    executions: Counter[str] = field(default_factory=Counter)
    ws_connections: int = 0  # accepted since start/reset
    # The most prompts queued and running at once, since start/reset (counted on each POST).
    peak_in_queue: int = 0
    # Epoch seconds (time.time()) per prompt_id: when it entered the running queue, and when it
    # left it (success, error or interrupted; the history entry is written at that same moment).
    # Both describe a prompt_id's latest run: a re-run drops the old `ended_at` when it starts,
    # so a started prompt without `ended_at` is still in the running queue.
    started_at: dict[str, float] = field(default_factory=dict)
    ended_at: dict[str, float] = field(default_factory=dict)
    # GET /sim/progress (not in /sim/stats: thousands of entries per prompt): per prompt_id of
    # its latest run, [node, value, max, epoch seconds] for every `progress` event, stamped when
    # the event is queued for the sockets, so a benchmark can time the way from here to a client.
    progress: dict[str, list[list[Any]]] = field(default_factory=dict)
    # How many prompts `progress` keeps (a setting: /sim/reset leaves it alone).
    progress_log_prompts: int = PROGRESS_LOG_PROMPTS

    def progress_started(self, prompt_id: str) -> None:
        """A (re-)run of the prompt starts an empty log; the oldest prompt's log is dropped."""
        self.progress.pop(prompt_id, None)
        while len(self.progress) >= self.progress_log_prompts:
            self.progress.pop(next(iter(self.progress)))
        self.progress[prompt_id] = []

    def record_progress(self, prompt_id: str, node: str, value: float, maximum: float) -> None:
        log = self.progress.get(prompt_id)
        if log is not None:
            log.append([node, value, maximum, time.time()])

    def reset(self) -> None:
        fresh = SimStats(progress_log_prompts=self.progress_log_prompts)
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))

    def as_json(self, ws_open: int) -> dict[str, Any]:
        return {
            "prompts": dict(self.prompts),
            "rejected": self.rejected,
            "interrupts": list(self.interrupts),
            "interrupted": list(self.interrupted),
            "frees": self.frees,
            "executed": dict(self.executed),
            "executions": dict(self.executions),
            "ws_connections": self.ws_connections,
            "ws_open": ws_open,
            "peak_in_queue": self.peak_in_queue,
            "started_at": dict(self.started_at),
            "ended_at": dict(self.ended_at),
        }
