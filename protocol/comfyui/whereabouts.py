"""Where a prompt is on one ComfyUI: in line (and its place), running, finished (with its
history entry) or unknown to it.

Asked on every submission (is the prompt already there?) and whenever a followed prompt's
socket falls silent, so it must not cost what the population costs: `/queue` sends the whole
graph of every queued and running prompt (about 1.4 KB each for the benchmark's, tens of KB for
a real workflow), read once per look. ComfyUI's jobs API (0.8 and later) answers the same
question about one prompt in a few hundred bytes, and lists the pending ones without their
graphs for the place in line; an older ComfyUI is asked through `/queue` and `/history` as
before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from protocol.comfyui.client import ComfyClient, JobLookup

Where = Literal["pending", "running", "finished", "unknown"]


@dataclass(frozen=True)
class Whereabouts:
    """`position` 1 means next to run (None: in line, place not known); `entry` is the history
    entry of a finished prompt."""

    where: Where
    position: int | None = None
    entry: dict[str, Any] | None = None


async def is_known(client: ComfyClient, prompt_id: str) -> bool:
    """Whether ComfyUI has the prompt anywhere: queued, running or in its history."""
    lookup = await client.job(prompt_id)
    if lookup is not None:
        return lookup.status is not None
    return (await _from_queue(client, prompt_id)).where != "unknown"


async def whereabouts(client: ComfyClient, prompt_id: str) -> Whereabouts:
    lookup = await client.job(prompt_id)
    if lookup is None:
        return await _from_queue(client, prompt_id)
    return await _from_jobs(client, prompt_id, lookup)


async def _from_jobs(client: ComfyClient, prompt_id: str, lookup: JobLookup) -> Whereabouts:
    for _ in range(2):
        if lookup.status == "in_progress":
            return Whereabouts("running")
        if lookup.status is None:
            return Whereabouts("unknown")
        if lookup.status != "pending":
            return await _finished(client, prompt_id)
        position = place_in_line(await client.pending_jobs(), prompt_id)
        if position is not None:
            return Whereabouts("pending", position)
        # It left the line between the two calls: where to?
        lookup = await client.job(prompt_id) or JobLookup(None)
    return Whereabouts("pending")


def place_in_line(pending: list[dict[str, Any]], prompt_id: str) -> int | None:
    """1 + how many pending prompts run before this one: ComfyUI runs them by priority (their
    `number`), lowest first; the listing itself is sorted by creation time."""
    ordered = sorted(pending, key=lambda job: job.get("priority") or 0)
    for index, job in enumerate(ordered):
        if job.get("id") == prompt_id:
            return index + 1
    return None


async def _from_queue(client: ComfyClient, prompt_id: str) -> Whereabouts:
    place = await client.queue_place(prompt_id)
    if place.where == "pending":
        return Whereabouts("pending", place.position)
    if place.where == "running":
        return Whereabouts("running")
    return await _finished(client, prompt_id)


async def _finished(client: ComfyClient, prompt_id: str) -> Whereabouts:
    entry = await client.history(prompt_id)
    return Whereabouts("unknown") if entry is None else Whereabouts("finished", entry=entry)
