"""ComfyUI WebSocket frames as typed events (docs/comfyui-protocol.md, "WebSocket").

Binary frames (previews) and unknown types are ignored; anything that is not about our prompt is
dropped by `for_prompt`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ComfyEvent(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    data: dict[str, Any]

    @property
    def prompt_id(self) -> str | None:
        value = self.data.get("prompt_id")
        return value if isinstance(value, str) else None

    @property
    def node(self) -> str | None:
        value = self.data.get("node")
        return None if value is None else str(value)


# The events about one prompt, which ComfyUI sends only to the prompt's client_id: the only ones
# a follower uses. The others are broadcasts to every socket (`status` on every queue change,
# `progress_state` with every step, custom nodes' monitors): with N prompts followed, N sockets
# each get every prompt's, N squared frames in all.
PROMPT_EVENTS = frozenset(
    {
        "execution_start",
        "execution_cached",
        "executing",
        "progress",
        "executed",
        "execution_success",
        "execution_error",
        "execution_interrupted",
    }
)
# How ComfyUI's aiohttp (`json.dumps({"type": event, "data": data})`) begins every frame.
_TYPE_FIRST = '{"type": "'


def parse_frame(frame: str | bytes) -> ComfyEvent | None:
    """A text frame as an event about a prompt (`PROMPT_EVENTS`); None for binary previews,
    broadcasts and anything malformed. A frame that names its type first is dropped by that name
    before it is decoded; any other is decoded first."""
    if isinstance(frame, bytes):
        return None
    if frame.startswith(_TYPE_FIRST):
        end = frame.find('"', len(_TYPE_FIRST))
        if frame[len(_TYPE_FIRST) : end] not in PROMPT_EVENTS:
            return None
    try:
        raw = json.loads(frame)
    except ValueError:
        return None
    if not isinstance(raw, dict) or raw.get("type") not in PROMPT_EVENTS:
        return None
    data = raw.get("data")
    # Both fields are checked above: no validation pass per frame.
    return ComfyEvent.model_construct(type=raw["type"], data=data if isinstance(data, dict) else {})


def for_prompt(event: ComfyEvent, prompt_id: str) -> bool:
    """Events that carry another prompt's ID are not ours; `executing` on connect has none."""
    return event.prompt_id in (None, prompt_id)


def output_files(outputs: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """(node_id, item) for every output item that names a file, whatever the list is called.

    Output lists vary by node (`images`, `gifs`, `audio`, `animated`, ...): walk them all.
    """
    found: list[tuple[str, dict[str, str]]] = []
    for node_id, node_output in outputs.items():
        if not isinstance(node_output, dict):
            continue
        for items in node_output.values():
            if not isinstance(items, list):
                continue
            for item in items:
                if isinstance(item, dict) and isinstance(item.get("filename"), str):
                    found.append((str(node_id), {k: str(v) for k, v in item.items()}))
    return found


def is_out_of_memory(data: dict[str, Any]) -> bool:
    text = f"{data.get('exception_type', '')} {data.get('exception_message', '')}".lower()
    return "out of memory" in text or "outofmemory" in text


def is_fatal_device_error(data: dict[str, Any]) -> bool:
    """CUDA faults that do not recover: the backend must be replaced, not retried."""
    text = str(data.get("exception_message", "")).lower()
    return "illegal memory access" in text or "device-side assert" in text


class Ending(BaseModel):
    """How a prompt ended, from its history entry's own messages."""

    outcome: Literal["success", "interrupted", "error", "unknown"]
    node: str | None = None
    node_type: str | None = None
    message: str = ""


def ending_of(entry: dict[str, Any] | None) -> Ending:
    """Read `status.messages` of a history entry; `unknown` when there is none."""
    if not isinstance(entry, dict):
        return Ending(outcome="unknown")
    status = entry.get("status")
    if not isinstance(status, dict):
        status = {}
    for item in status.get("messages") or []:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)):
            continue
        event, data = item
        node = None if data.get("node_id") is None else str(data.get("node_id"))
        node_type = None if data.get("node_type") is None else str(data.get("node_type"))
        if event == "execution_interrupted":
            return Ending(outcome="interrupted", node=node, node_type=node_type)
        if event == "execution_error":
            message = f"{data.get('exception_type')}: {data.get('exception_message')}"
            return Ending(outcome="error", node=node, node_type=node_type, message=message)
    if status.get("status_str") == "error":
        return Ending(outcome="error")
    return Ending(outcome="success")
