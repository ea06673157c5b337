"""A ComfyUI simulator per RunPod worker that leaves its counters behind when its worker goes.

Loaded by the RunPod simulator (`--worker-env-factory faults.soak.comfy_factory:
SoakComfyPerWorker`), in the simulator's process. It is the stock `ComfySimPerWorker`, which
leaves two files in the worker's directory:

- `comfy.json` when the worker starts: its ComfyUI's URL and PID, so the soak can arm socket
  faults on it and ask its queue while it lives;
- `comfy-final.json` when the worker is gone, just before its ComfyUI is stopped; here not only
  `/sim/stats` (prompts queued and executed per prompt id) but also `/queue` and a summary of
  `/history` (each prompt's extra_data tag: whose it was). A worker's ComfyUI dies with it, and
  its counters would die too: this is what the soak counts duplicate GPU executions and
  left-over prompts from.

The simulator's own arguments for each ComfyUI come from $SOAK_COMFY_SIM_ARGS (the factory is
built without any).
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import aiohttp

from devstack.runpod_sim.env_factories import (
    COMFY_FINAL_FILE,
    COMFY_HANDLE_FILE,
    ComfySimPerWorker,
)

ARGS_VAR = "SOAK_COMFY_SIM_ARGS"
HANDLE_FILE = COMFY_HANDLE_FILE
FINAL_FILE = COMFY_FINAL_FILE


def prompt_tags(history: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """prompt id -> the durable-comfy tags in its extra_data (whose prompt it was)."""
    tags: dict[str, dict[str, Any]] = {}
    for prompt_id, entry in history.items():
        try:
            extra = entry["prompt"][3]
        except (KeyError, IndexError, TypeError):
            continue
        if isinstance(extra, dict):
            tags[prompt_id] = {k: v for k, v in extra.items() if k.startswith("durable_comfy")}
    return tags


async def snapshot(url: str) -> dict[str, Any]:
    """What a ComfyUI simulator holds now: counters, queue, and each known prompt's tag."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as http:
        parts: dict[str, Any] = {}
        for name, path in (("stats", "/sim/stats"), ("queue", "/queue"), ("history", "/history")):
            async with http.get(f"{url}{path}") as response:
                response.raise_for_status()
                parts[name] = await response.json()
    queue = parts["queue"]
    # The tags of prompts still queued or running (not in the history yet) too.
    items = [*queue.get("queue_running", []), *queue.get("queue_pending", [])]
    tags = prompt_tags({str(item[1]): {"prompt": item} for item in items})
    tags.update(prompt_tags(parts["history"]))
    return {
        "stats": parts["stats"],
        "running": [str(item[1]) for item in queue.get("queue_running", [])],
        "pending": [str(item[1]) for item in queue.get("queue_pending", [])],
        "tags": tags,
    }


class SoakComfyPerWorker(ComfySimPerWorker):
    def __init__(self) -> None:
        super().__init__(shlex.split(os.environ.get(ARGS_VAR, "")))

    async def final_state(self, url: str) -> dict[str, Any]:
        return await snapshot(url)
