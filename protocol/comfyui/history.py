"""Finding a prompt's outputs: its history entry, the source of truth once it has ended.

One routine for both sides of ComfyUI: the orchestrator's offload (activities/comfyui/offload.py)
and the RunPod handler's follower (`PromptFollower.ending`, endpoint/execution.py). Needs only
the ComfyUI client: the handler's venv has no Temporal, so its error (`HistoryMissing`) is
protocol.errors', which each side translates its own way.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from protocol.comfyui.client import ComfyClient
from protocol.errors import HistoryMissing

# `execution_success` arrives before ComfyUI writes the history entry: this long, at most.
HISTORY_WAIT_S = 10.0
HISTORY_POLL_S = 0.2


async def history_when_written(
    client: ComfyClient, prompt_id: str, *, wait_s: float = HISTORY_WAIT_S
) -> dict[str, Any]:
    """The prompt's history entry, waiting up to `wait_s` for ComfyUI to write it.

    Raises `HistoryMissing` past the wait; the client's `ComfyError`s pass through."""
    deadline = time.monotonic() + wait_s
    while True:
        entry = await client.history(prompt_id)
        if entry is not None:
            return entry
        if time.monotonic() > deadline:
            raise HistoryMissing(
                f"prompt {prompt_id} ended but ComfyUI wrote no history entry within {wait_s:.0f} s"
            )
        await asyncio.sleep(HISTORY_POLL_S)


def outputs_of(entry: dict[str, Any] | None) -> dict[str, Any]:
    """`{node_id: node output}` of a history entry (`events.output_files` walks the files)."""
    outputs = entry.get("outputs") if isinstance(entry, dict) else None
    return outputs if isinstance(outputs, dict) else {}


def failed_in_history(entry: dict[str, Any]) -> bool:
    """The entry's own status says the prompt failed."""
    status = entry.get("status")
    return isinstance(status, dict) and status.get("status_str") == "error"


def history_messages(entry: dict[str, Any]) -> list[Any]:
    status = entry.get("status")
    messages = status.get("messages") if isinstance(status, dict) else None
    return messages if isinstance(messages, list) else []
