"""Stopping a job's prompt after the platform stopped the job, until the worker's ComfyUI no
longer holds it, and saying how it ended (contract.StopRecord).

The loop: dequeue the prompt while it waits, send a prompt-scoped `/interrupt` while it runs
(again every STOP_REPEAT_S: interrupts are cooperative, and a node without a progress hook
notices one only at its end), and look at `/queue` until the prompt is neither pending nor
running; then `/history` says whether our interrupt ended it, it had finished or failed on its
own, or ComfyUI kept no record. All this for as long as the job's stop horizon allows, measured
from the first stop. A prompt still running then is `still_running`, and its worker has to be
replaced (`replace_this_worker`), or the next job would queue behind it and pay for it.

The platform may stop a job more than once (runpod re-sends job-stop until the worker lets go of
the job, and the SDK cancels the handler's task each time): `wait_out` lets one stop run to its
end whatever further cancels arrive.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog

from endpoint.comfy import process_alive
from protocol.comfyui.client import ComfyClient, QueuePlace
from protocol.comfyui.events import ending_of
from protocol.errors import ComfyError
from protocol.runpod.contract import PromptFate, StopRecord

log = structlog.get_logger(__name__)

STOP_POLL_S = 0.2
# Interrupts are cooperative and a prompt may start between our checks: ask again this often.
STOP_REPEAT_S = 1.0
# ComfyUI writes the history entry as the prompt leaves the queue; allow for a slower one.
HISTORY_WAIT_S = 2.0
# A POST /prompt cut short by the stop may still land on ComfyUI: look for it this long.
LATE_POST_S = 1.0
# Stop requests logged one by one up to this many, then every LOG_EVERY-th.
LOG_FIRST = 3
LOG_EVERY = 10

# Replaces this worker (its ComfyUI runs a prompt that would not stop); see replace_this_worker.
WorkerReplacer = Callable[[], None]


@dataclass(frozen=True)
class StopSubject:
    """What the stop needs to know of the run it stops."""

    prompt_id: str
    # ComfyUI may hold the prompt: it was posted (answered or not) or found there.
    maybe_queued: bool
    # A POST /prompt was on its way when the stop came, and no answer arrived.
    post_in_flight: bool
    # The node running last we heard, and the graph for its class.
    current_node: Callable[[], str | None]
    graph: dict[str, Any]

    def node_type(self, node: str | None) -> str | None:
        entry = self.graph.get(node) if node is not None else None
        kind = entry.get("class_type") if isinstance(entry, dict) else None
        return str(kind) if kind is not None else None


async def stop_prompt(
    client: ComfyClient,
    subject: StopSubject,
    *,
    horizon_s: float,
    since: float,
    started_at: datetime,
    worker_id: str,
    comfy_pid: int | None = None,
) -> StopRecord:
    """Stop `subject`'s prompt until ComfyUI no longer holds it, or until `horizon_s` after
    `since` (time.monotonic() of the first stop); the record says what became of it."""
    stop = _Stop(client, subject, since + horizon_s, comfy_pid)
    bound = log.bind(prompt_id=subject.prompt_id)
    bound.info("prompt_stop_started", horizon_s=horizon_s, maybe_queued=subject.maybe_queued)
    fate, node, detail = await stop.run()
    if node is None and fate in ("interrupted", "still_running"):
        node = subject.current_node()
    node_type = stop.node_type or subject.node_type(node)
    record = StopRecord(
        prompt=fate,
        started_at=started_at,
        at=datetime.now(UTC),
        checks=stop.checks,
        requests=stop.requests,
        node=node,
        node_type=node_type,
        detail=_detail(fate, node, node_type, detail, stop.requests, time.monotonic() - since),
        worker_id=worker_id,
    )
    bound.info(
        "prompt_stopped",
        fate=fate,
        checks=stop.checks,
        requests=stop.requests,
        node=node,
        waited_s=round(time.monotonic() - since, 1),
    )
    return record


class _Stop:
    def __init__(
        self, client: ComfyClient, subject: StopSubject, deadline: float, comfy_pid: int | None
    ) -> None:
        self.client = client
        self.subject = subject
        self.prompt_id = subject.prompt_id
        self.deadline = deadline
        self.comfy_pid = comfy_pid
        self.checks = 0
        self.requests = 0
        self.node_type: str | None = None
        self.did: PromptFate | None = None  # "dequeued" or "interrupted", once asked
        self.log = log.bind(prompt_id=subject.prompt_id)

    async def run(self) -> tuple[PromptFate, str | None, str]:
        """(fate, node, what else to say)."""
        if not self.subject.maybe_queued and not self.subject.post_in_flight:
            # Nothing was sent: still, one look, since an earlier handler of this job may
            # have left the prompt there.
            place = await self._place()
            if place is None or place.where is None:
                return await self._ended(cut_short=False)
        late_until = time.monotonic() + (LATE_POST_S if self.subject.post_in_flight else 0.0)
        asked_at = float("-inf")
        unreachable = "ComfyUI did not answer"
        while True:
            place = await self._place()
            if place is None:
                if self.comfy_pid is not None and not process_alive(self.comfy_pid):
                    return "gone", None, f"ComfyUI (pid {self.comfy_pid}) exited meanwhile"
            elif place.where is None:
                if time.monotonic() < late_until:
                    await asyncio.sleep(STOP_POLL_S)
                    continue
                return await self._ended(cut_short=True)
            if time.monotonic() >= self.deadline:
                # Unreachable at the end counts as still running: nothing says it stopped.
                return "still_running", None, unreachable if place is None else ""
            if place is not None and time.monotonic() - asked_at >= STOP_REPEAT_S:
                asked_at = time.monotonic()
                await self._ask(place)
            await asyncio.sleep(STOP_POLL_S)

    async def _place(self) -> QueuePlace | None:
        self.checks += 1
        try:
            return await self.client.queue_place(self.prompt_id)
        except (ComfyError, ValueError) as exc:
            if self.checks == 1 or self.checks % LOG_EVERY == 0:
                self.log.warning("prompt_stop_check_failed", error=str(exc), checks=self.checks)
            return None

    async def _ask(self, place: QueuePlace) -> None:
        pending = place.where == "pending"
        try:
            if pending:
                await self.client.delete_pending(self.prompt_id)
            else:
                await self.client.interrupt(self.prompt_id)
        except ComfyError as exc:
            self.log.warning("prompt_stop_request_failed", error=str(exc))
            return
        self.did = (self.did or "dequeued") if pending else "interrupted"
        self.requests += 1
        if self.requests <= LOG_FIRST or self.requests % LOG_EVERY == 0:
            self.log.info("prompt_stop_sent", action=self.did, requests=self.requests)

    async def _ended(self, *, cut_short: bool) -> tuple[PromptFate, str | None, str]:
        """The prompt is neither pending nor running: read how it ended."""
        entry = await self._history(wait=cut_short and self.did == "interrupted")
        if entry is None:
            if self.did == "dequeued":
                return "dequeued", None, ""
            if not self.subject.maybe_queued:
                return "never_submitted", None, ""
            if self.subject.post_in_flight:
                return "never_submitted", None, "its POST /prompt was cut short and never landed"
            return "gone", None, ""
        ending = ending_of(entry)
        self.node_type = ending.node_type
        if ending.outcome == "interrupted":
            return "interrupted", ending.node, ""
        if ending.outcome == "error":
            return "failed", ending.node, ending.message
        return "finished", None, ""

    async def _history(self, *, wait: bool) -> dict[str, Any] | None:
        until = time.monotonic() + (HISTORY_WAIT_S if wait else 0.0)
        while True:
            self.checks += 1
            try:
                entry = await self.client.history(self.prompt_id)
            except (ComfyError, ValueError) as exc:
                self.log.warning("prompt_stop_history_failed", error=str(exc))
                entry = None
            if entry is not None or time.monotonic() >= until:
                return entry
            await asyncio.sleep(STOP_POLL_S)


def _detail(
    fate: PromptFate,
    node: str | None,
    node_type: str | None,
    extra: str,
    requests: int,
    waited_s: float,
) -> str:
    at = f"node {node} ({node_type or '?'})" if node else "the prompt"
    asked = f"{requests} stop request(s)"
    text = {
        "never_submitted": "stopped before the prompt reached ComfyUI",
        "dequeued": "taken out of ComfyUI's queue before it started",
        "interrupted": f"interrupted at {at} {waited_s:.1f} s after the stop, after {asked}",
        "finished": "it had finished before the stop took effect",
        "failed": f"it had failed on its own at {at}",
        "gone": "no longer queued or running, and ComfyUI has no record of how it ended",
        "still_running": (
            f"{at} still running {waited_s:.0f} s after the stop despite {asked}: "
            "the worker is replaced"
        ),
    }[fate]
    return f"{text} ({extra})" if extra else text


async def wait_out(task: asyncio.Future[Any], what: str) -> bool:
    """Wait for `task` to end even while our own task is cancelled, again and again (its
    outcome stays in it); True when we were cancelled meanwhile (the caller re-raises then)."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            if not cancelled:
                log.info("stop_repeated", doing=what, note="already stopping: it goes on")
            cancelled = True
    return cancelled


def replace_this_worker(comfy_pid: int | None) -> WorkerReplacer:
    """The act that replaces a worker whose ComfyUI will not let go of a prompt: SIGKILL to
    ComfyUI (when its pid is known), then SIGTERM to this process. Under the runpod SDK SIGTERM
    is a graceful shutdown: it takes no further job, lets the handler's task return, and the
    process exits; the platform then starts a fresh worker for the endpoint's next job."""

    def replace() -> None:
        if comfy_pid is not None:
            try:
                os.kill(comfy_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    return replace
