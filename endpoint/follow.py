"""Submitting one prompt to the worker's ComfyUI and following it to its end, with the rules of
the orchestrator's own follower (activities/comfyui/follow.py, docs/comfyui-protocol.md):

- the socket opens with the prompt's client_id *before* POST /prompt, so no event is missed;
- POST only when /queue, /history and /api/jobs all do not know the prompt: a restarted handler
  re-attaches to the prompt its predecessor submitted instead of running it twice;
- a socket silent for a poll: /queue and /history are asked; a *running* prompt's socket
  silent for two polls is reopened (ComfyUI forgets a client_id when any socket with it closes);
  one waiting in the queue is merely quiet;
- `execution_cached` nodes count as done; the queue position is reported while waiting;
- the ending and the outputs are read from /history, the source of truth.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import structlog
import websockets

from activities.comfyui.client import ComfyClient, ComfyUnavailable
from activities.comfyui.events import ComfyEvent, ending_of, for_prompt, parse_frame
from activities.progress import ProgressTracker
from endpoint.comfy import ComfyGone

log = structlog.get_logger(__name__)

# Events ComfyUI sends only to the prompt's client_id (status and progress_state go to all).
ROUTED_EVENTS = frozenset(
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
RESUBSCRIBE_AFTER_POLLS = 2
# Asked twice, this far apart, before a prompt counts as lost.
LOST_RECHECK_S = 1.0
# `execution_success` arrives before the history entry is written.
HISTORY_WAIT_S = 10.0
RECONNECT_DELAY_S = 1.0

Stage = Literal["queued", "running"]


class PromptLost(Exception):
    """ComfyUI knows nothing of a prompt it was given (it restarted)."""


class HistoryMissing(Exception):
    """The prompt ended but ComfyUI wrote no history entry for it."""


class Listener(Protocol):
    """What the follower tells its job about; `check` may raise to abort following."""

    def stage(self, stage: Stage, position: int | None) -> None: ...

    def node(self, node: str | None) -> None: ...

    def moved(self) -> None: ...

    def outputs(self, outputs: dict[str, Any]) -> None: ...

    def check(self) -> None: ...


@dataclass(frozen=True)
class PromptEnd:
    """How the prompt ended, read from its history entry."""

    outcome: Literal["success", "error", "interrupted"]
    entry: dict[str, Any]
    node: str | None = None
    node_type: str | None = None
    message: str = ""
    # `execution_error`'s data (exception_type, exception_message, ...) when it failed.
    error: dict[str, Any] = field(default_factory=dict)


class PromptFollower:
    def __init__(
        self,
        client: ComfyClient,
        *,
        prompt_id: str,
        client_id: str,
        graph: dict[str, Any],
        extra_data: dict[str, Any],
        tracker: ProgressTracker,
        listener: Listener,
        poll_s: float,
        lost_after_s: float,
    ) -> None:
        self.client = client
        self.prompt_id = prompt_id
        self.client_id = client_id
        self.graph = graph
        self.extra_data = extra_data
        self.tracker = tracker
        self.listener = listener
        self.poll_s = poll_s
        self.lost_after_s = lost_after_s
        # True once ComfyUI has the prompt (we posted it, or found it there).
        self.submitted = False
        # True from the moment a POST /prompt went out (or the prompt was found there): ComfyUI
        # may hold it even if no answer came, so a stop must look for it.
        self.maybe_queued = False
        self.attached = False  # found it there: a predecessor submitted it
        self.stage: Stage | None = None
        self.queue_position: int | None = None
        self.current_node: str | None = None
        self.ended: str | None = None
        self.entry: dict[str, Any] | None = None
        self.error_data: dict[str, Any] = {}
        self.last_routed = time.monotonic()
        self.last_contact = time.monotonic()
        self.log = log.bind(prompt_id=prompt_id)

    async def run(self) -> PromptEnd:
        while self.ended is None:
            try:
                await self._follow_socket()
            except (OSError, websockets.exceptions.WebSocketException, ComfyUnavailable) as exc:
                silent_s = time.monotonic() - self.last_contact
                if silent_s > self.lost_after_s:
                    raise ComfyGone(
                        f"ComfyUI unreachable for {silent_s:.0f} s while following prompt "
                        f"{self.prompt_id}: {type(exc).__name__}: {exc}"
                    ) from exc
                self.log.warning("comfy_connection_lost", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(RECONNECT_DELAY_S)
        return await self._ending()

    async def _follow_socket(self) -> None:
        """One socket's life: submit or reconcile, then events until the end or a silence."""
        async with websockets.connect(
            self.client.ws_url(self.client_id), max_size=None, open_timeout=10
        ) as ws:
            self.last_contact = self.last_routed = time.monotonic()
            if not self.submitted:
                await self._submit_unless_known()
            else:
                await self._reconcile()
            while self.ended is None:
                if await self._next_event(ws):
                    self.last_routed = time.monotonic()
                elif (
                    self.ended is None
                    and self.stage == "running"
                    and time.monotonic() - self.last_routed > RESUBSCRIBE_AFTER_POLLS * self.poll_s
                ):
                    self.log.info("socket_silent_reopening")
                    return
                self.listener.check()

    async def _submit_unless_known(self) -> None:
        if await self._known():
            self.submitted = self.attached = self.maybe_queued = True
            self.log.info("prompt_reattached")
            await self._reconcile()
            return
        self.maybe_queued = True
        answer = await self.client.post_prompt(
            self.graph,
            prompt_id=self.prompt_id,
            client_id=self.client_id,
            extra_data=self.extra_data,
        )
        self.submitted = True
        dropped = answer.get("node_errors") or {}
        if dropped:
            # ComfyUI runs the valid outputs and drops the others: say which.
            self.log.warning("outputs_dropped_by_comfyui", node_errors=dropped)
        self.log.info("prompt_submitted", number=answer.get("number"))
        # Nothing can have been missed on a socket opened before the submission.
        place = await self.client.queue_place(self.prompt_id)
        if place.where == "pending":
            self._set_stage("queued", place.position)

    async def _known(self) -> bool:
        if await self.client.queue_position(self.prompt_id) is not None:
            return True
        if await self.client.history(self.prompt_id) is not None:
            return True
        return await self.client.job_state(self.prompt_id) is not None

    async def _next_event(self, ws: websockets.ClientConnection) -> bool:
        """Handle the next frame; True only for an event routed to our client_id."""
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives as the frame does (and frames arrive every few ms while another
            # prompt runs), so the platform's job-stop would be lost.
            async with asyncio.timeout(self.poll_s):
                frame = await ws.recv()
        except TimeoutError:
            # A silent socket on a live prompt is not a failure: ask the source of truth.
            await self._reconcile()
            return False
        self.last_contact = time.monotonic()
        event = parse_frame(frame)
        if event is None or not for_prompt(event, self.prompt_id):
            return False
        self._handle(event)
        return event.type in ROUTED_EVENTS

    def _set_stage(self, stage: Stage, position: int | None = None) -> None:
        if (stage, position) == (self.stage, self.queue_position):
            return
        if stage != self.stage:
            self.last_routed = time.monotonic()  # silence counts from the prompt's start
        self.stage, self.queue_position = stage, position
        self.listener.stage(stage, position)

    def _handle(self, event: ComfyEvent) -> None:
        kind, data = event.type, event.data
        if kind in ("execution_start", "execution_cached", "executing", "progress") and not (
            kind == "executing" and event.node is None
        ):
            self._set_stage("running")
        if kind == "executing":
            if event.node is None:
                if event.prompt_id == self.prompt_id:
                    self.ended = self.ended or "success"
                return
            if self.current_node is not None and self.current_node != event.node:
                self.tracker.on_node_done(self.current_node)
            self.current_node = event.node
            self.listener.node(event.node)
        elif kind == "execution_cached":
            # Nodes served from ComfyUI's cache are done before anything runs.
            for node in data.get("nodes") or []:
                self.tracker.on_node_done(str(node))
            self.listener.moved()
        elif kind == "progress":
            if self.tracker.on_progress(event.node, int(data.get("value", 0))):
                self.listener.moved()
        elif kind == "executed":
            node = event.node or ""
            self.tracker.on_node_done(node)
            self.listener.moved()
            self.listener.outputs({node: data.get("output") or {}})
        elif kind == "execution_success":
            self.ended = "success"
        elif kind == "execution_error":
            self.ended, self.error_data = "error", dict(data)
        elif kind == "execution_interrupted":
            self.ended = "interrupted"

    async def _reconcile(self) -> None:
        """Ask /queue, then /history, where the prompt is. Only when neither (nor /api/jobs)
        knows it, twice, is it lost: `{}` from history alone can mean queued or running."""
        for look in range(2):
            place = await self.client.queue_place(self.prompt_id)
            self.last_contact = time.monotonic()
            if place.where == "pending":
                self._set_stage("queued", place.position)
                return
            if place.where == "running":
                self._set_stage("running")
                return
            entry = await self.client.history(self.prompt_id)
            if entry is not None:
                self.entry = entry
                self.ended = self.ended or "history"
                return
            if await self.client.job_state(self.prompt_id) in ("pending", "in_progress"):
                return
            if look == 0:
                await asyncio.sleep(LOST_RECHECK_S)
        raise PromptLost(
            f"prompt {self.prompt_id} is neither queued, running nor in ComfyUI's history: "
            "ComfyUI lost it (restarted?)"
        )

    async def _ending(self) -> PromptEnd:
        entry = self.entry or await self._history_when_written()
        self.listener.outputs(entry.get("outputs") or {})
        ending = ending_of(entry)
        error = _error_data(entry) or self.error_data
        if ending.outcome in ("error", "interrupted"):
            outcome: Literal["success", "error", "interrupted"] = ending.outcome
        elif self.ended in ("error", "interrupted"):
            outcome = "error" if self.ended == "error" else "interrupted"
        else:
            outcome = "success"
        message = ending.message or _message(error)
        self.log.info("prompt_ended", outcome=outcome, node=ending.node, message=message or None)
        return PromptEnd(outcome, entry, ending.node, ending.node_type, message, error)

    async def _history_when_written(self) -> dict[str, Any]:
        deadline = time.monotonic() + HISTORY_WAIT_S
        while True:
            entry = await self.client.history(self.prompt_id)
            if entry is not None:
                return entry
            if time.monotonic() > deadline:
                raise HistoryMissing(
                    f"prompt {self.prompt_id} ended ({self.ended}) but ComfyUI wrote no history "
                    f"entry within {HISTORY_WAIT_S:.0f} s"
                )
            await asyncio.sleep(0.2)


def _error_data(entry: dict[str, Any]) -> dict[str, Any]:
    status = entry.get("status")
    messages = status.get("messages") if isinstance(status, dict) else None
    for item in messages or []:
        if isinstance(item, list) and len(item) == 2 and item[0] == "execution_error":
            if isinstance(item[1], dict):
                return dict(item[1])
    return {}


def _message(error: dict[str, Any]) -> str:
    if not error:
        return ""
    return f"{error.get('exception_type')}: {error.get('exception_message')}"
