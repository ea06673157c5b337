"""Following one ComfyUI prompt to its end: the one implementation of the protocol's rules
(docs/comfyui-protocol.md), used by the orchestrator's follow activity
(activities/comfyui/follow.py) and by the RunPod handler (endpoint/execution.py).

- the socket opens with the prompt's client_id *before* POST /prompt, so no event is missed;
- POST only when /queue, /history and /api/jobs all do not know the prompt: an attempt after a
  lost answer, or a restarted handler, re-attaches instead of running it twice;
- a socket silent for a poll: /queue and /history are asked (the source of truth); a *running*
  prompt's socket silent for two polls is reopened (ComfyUI forgets a client_id when any socket
  with it closes); one waiting in the queue is merely quiet, and says its place;
- a prompt neither /queue, /history nor /api/jobs knows, asked twice a recheck apart, is lost;
- `execution_cached` nodes count as done; every routed event moves the `ProgressTracker`.

What happens because of an event is the listener's business (`FollowListener`): the
orchestrator's heartbeats, signals the workflow and uploads to S3; the handler's reports to
RunPod and stores outputs its way. Policy differs by parameter: whether a graph is submitted at
all, and whether a lost connection is reconnected here (the handler) or raised (the
orchestrator, whose workflow re-attaches with a fresh attempt).

Temporal-free on purpose: the handler's venv has no temporalio (tests/test_layers.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import structlog
import websockets

from protocol.comfyui.client import ComfyClient
from protocol.comfyui.events import ComfyEvent, ending_of, for_prompt, parse_frame
from protocol.comfyui.history import history_when_written, outputs_of
from protocol.comfyui.silence import SilenceTimer
from protocol.comfyui.socket import comfy_socket
from protocol.comfyui.whereabouts import is_known, whereabouts
from protocol.errors import ComfyGone, ComfyUnavailable, PromptLost
from protocol.progress import ProgressTracker

# A socket silent this many polls while the prompt runs is reopened: ComfyUI unregisters a
# client_id when any socket of that ID closes, so an older socket closing late can leave ours
# deaf. Reopening registers the ID again; a silent node merely costs a reconnect.
RESUBSCRIBE_AFTER_POLLS = 2
# Asked twice, this far apart, before a prompt counts as lost.
LOST_RECHECK_S = 1.0
# Between reconnects, when the follower reconnects at all (`reconnect_for_s`).
RECONNECT_DELAY_S = 1.0

Stage = Literal["queued", "running"]
# How the follower saw the prompt end: an event, or its history entry found by a look.
Seen = Literal["success", "error", "interrupted", "history"]


class FollowListener(Protocol):
    """What the follower tells whoever follows the prompt. Any method may raise to stop
    following (the exception passes through `follow`/`run`)."""

    async def submitted(self) -> None:
        """The prompt is on ComfyUI: we posted it, or found it there."""

    async def stage(self, stage: Stage, position: int | None) -> None:
        """The prompt waits in the queue (at `position`, 1 = next) or runs."""

    async def node(self, node: str) -> None:
        """A node began executing (the tracker already counted the previous one done)."""

    async def moved(self) -> None:
        """The tracker advanced without a node change: cached nodes, a sampler step."""

    async def executed(self, node: str, output: dict[str, Any]) -> None:
        """A node finished; `output` is its record (it may name files)."""

    async def outputs(self, outputs: dict[str, Any]) -> None:
        """The history entry names the prompt's outputs (`{node_id: node output}`)."""

    def beat(self) -> None:
        """After each frame about the prompt, and each silent poll: a sign of life."""

    def check(self) -> None:
        """Between frames: raise to abort (an upload failed, the worker is shutting down)."""


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
    """One prompt followed over one ComfyUI client, from submission (or re-attachment) to its
    end. `follow()` returns once the prompt has ended; `ending()` then reads how from history;
    `run()` is both."""

    def __init__(
        self,
        client: ComfyClient,
        listener: FollowListener,
        *,
        prompt_id: str,
        client_id: str,
        tracker: ProgressTracker,
        poll_s: float,
        graph: dict[str, Any] | None = None,
        extra_data: dict[str, Any] | None = None,
        submitted: bool = False,
        first_post: bool = False,
        reconnect_for_s: float | None = None,
        log: Any = None,
    ) -> None:
        """`graph`: submit it unless ComfyUI already has the prompt (None: only re-attach).
        `submitted`: an earlier attempt did, so only re-attach. `first_post`: nothing can have
        posted the prompt before, so the first POST goes without asking. `reconnect_for_s`: a lost
        socket or ComfyUI unavailable is reconnected while ComfyUI answered within this long,
        then `ComfyGone`; None raises the error as it came."""
        self.client = client
        self.listener = listener
        self.prompt_id = prompt_id
        self.client_id = client_id
        self.tracker = tracker
        self.poll_s = poll_s
        self.graph = graph
        self.first_post = first_post
        self.extra_data = extra_data or {}
        self.reconnect_for_s = reconnect_for_s
        self.log = (
            log if log is not None else structlog.get_logger(__name__).bind(prompt_id=prompt_id)
        )
        # True once ComfyUI has the prompt (we posted it, or found it there).
        self.submitted = submitted
        # True from the moment a POST /prompt went out (or the prompt was found there): ComfyUI
        # may hold it even if no answer came, so a stop must look for it.
        self.maybe_queued = submitted
        self.attached = False  # found it there: a predecessor submitted it
        self.stage: Stage | None = None
        self.queue_position: int | None = None
        self.current_node: str | None = None
        self.ended: Seen | None = None
        # The data of the event that ended it (execution_error, execution_interrupted).
        self.end_data: dict[str, Any] = {}
        # The history entry, once a look found it.
        self.entry: dict[str, Any] | None = None
        self.last_routed = time.monotonic()
        self.last_contact = time.monotonic()

    async def run(self) -> PromptEnd:
        await self.follow()
        return await self.ending()

    async def follow(self) -> Seen:
        """Follow until the prompt has ended; say how that was seen."""
        while self.ended is None:
            try:
                await self._follow_socket()
            except (OSError, websockets.exceptions.WebSocketException, ComfyUnavailable) as exc:
                if self.reconnect_for_s is None:
                    raise
                silent_s = time.monotonic() - self.last_contact
                if silent_s > self.reconnect_for_s:
                    raise ComfyGone(
                        f"ComfyUI unreachable for {silent_s:.0f} s while following prompt "
                        f"{self.prompt_id}: {type(exc).__name__}: {exc}"
                    ) from exc
                self.log.warning("comfy_connection_lost", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(RECONNECT_DELAY_S)
        return self.ended

    async def ending(self) -> PromptEnd:
        """How the prompt ended, from its history entry (waited for when no look found it);
        the entry's outputs go to the listener. Raises `HistoryMissing` when none is written."""
        if self.entry is None:
            self.entry = await history_when_written(self.client, self.prompt_id)
        entry = self.entry
        await self.listener.outputs(outputs_of(entry))
        ending = ending_of(entry)
        error = _error_data(entry) or (self.end_data if self.ended == "error" else {})
        if ending.outcome in ("error", "interrupted"):
            outcome: Literal["success", "error", "interrupted"] = ending.outcome
        elif self.ended in ("error", "interrupted"):
            outcome = "error" if self.ended == "error" else "interrupted"
        else:
            outcome = "success"
        message = ending.message or _message(error)
        self.log.info("prompt_ended", outcome=outcome, node=ending.node, message=message or None)
        return PromptEnd(outcome, entry, ending.node, ending.node_type, message, error)

    async def _follow_socket(self) -> None:
        """One socket's life: submit or reconcile, then events until the end or a silence.

        The prompt's client_id takes its event routing over from a dead socket; a fresh ID
        would get none of its events."""
        # No permessage-deflate: ComfyUI's aiohttp socket accepts it, and then every frame (a
        # few hundred bytes of JSON, or an already-compressed preview) is deflated there and
        # inflated here, with a zlib window per followed prompt in the worker's memory.
        async with comfy_socket(
            self.client.ws_url(self.client_id), max_size=None, open_timeout=10, compression=None
        ) as ws:
            with SilenceTimer(self.poll_s) as silence:
                self.last_contact = self.last_routed = time.monotonic()
                if self.graph is not None and not self.submitted:
                    await self._submit_unless_known(self.graph)
                else:
                    await self._reconcile()
                while self.ended is None:
                    if await self._next_event(ws, silence):
                        self.last_routed = time.monotonic()
                    elif (
                        self.ended is None
                        and self.stage == "running"
                        and time.monotonic() - self.last_routed
                        > RESUBSCRIBE_AFTER_POLLS * self.poll_s
                    ):
                        # Only a running prompt owes us events: one waiting in the queue is quiet.
                        self.log.info("socket_silent_reopening")
                        return
                    self.listener.check()

    async def _submit_unless_known(self, graph: dict[str, Any]) -> None:
        """POST /prompt with our prompt_id, unless ComfyUI already has it: the prompt_id is
        ours, so after a lost answer we ask instead of queueing (and paying for) it twice; the
        first POST of a prompt nobody posted before goes without asking (a round trip on every
        job's critical path)."""
        first_post, self.first_post = self.first_post, False
        if not first_post and await is_known(self.client, self.prompt_id):
            self.submitted = self.attached = self.maybe_queued = True
            self.log.info("submit_already_known")
            await self.listener.submitted()
            await self._reconcile()
            return
        self.maybe_queued = True
        answer = await self.client.post_prompt(
            graph, prompt_id=self.prompt_id, client_id=self.client_id, extra_data=self.extra_data
        )
        self.submitted = True
        dropped = answer.get("node_errors") or {}
        if dropped:
            # ComfyUI runs the valid outputs and drops the others: say which.
            self.log.warning("outputs_dropped_by_comfyui", node_errors=dropped)
        self.log.info("submitted", number=answer.get("number"), dropped_outputs=len(dropped))
        await self.listener.submitted()
        # Nothing can have been missed on a socket opened before the submission: the events
        # (buffered if the prompt ran at once) tell the rest, not /history.
        found = await whereabouts(self.client, self.prompt_id)
        if found.where == "pending":
            await self._set_stage("queued", found.position)

    async def _next_event(self, ws: websockets.ClientConnection, silence: SilenceTimer) -> bool:
        """Handle the next frame; True only for an event routed to our client_id. Only the
        wait for the frame is timed: handling it (an upload) never counts as silence."""
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel (Temporal's, the
            # platform's job-stop) that lands while a frame arrives, and frames arrive every few
            # ms while another prompt runs, so the cancel would be lost for good.
            frame = await silence.wait(ws.recv())
        except TimeoutError:
            self.listener.beat()
            # A silent socket on a live prompt is not a failure: ask the source of truth.
            await self._reconcile()
            return False
        self.last_contact = time.monotonic()
        event = parse_frame(frame)
        if event is None or not for_prompt(event, self.prompt_id):
            return False
        await self._handle(event)
        self.listener.beat()
        return True  # parse_frame keeps only the events routed to our client_id

    async def _set_stage(self, stage: Stage, position: int | None = None) -> None:
        if (stage, position) == (self.stage, self.queue_position):
            return
        if stage != self.stage:
            self.last_routed = time.monotonic()  # silence counts from the prompt's start
        self.stage, self.queue_position = stage, position
        await self.listener.stage(stage, position)

    async def _handle(self, event: ComfyEvent) -> None:
        kind, data = event.type, event.data
        if kind in ("execution_start", "execution_cached", "executing", "progress") and not (
            kind == "executing" and event.node is None
        ):
            await self._set_stage("running")
        if kind == "executing":
            if event.node is None:
                # The end, when it names our prompt (one on connect names none).
                if event.prompt_id == self.prompt_id:
                    self.ended = self.ended or "success"
                return
            if self.current_node is not None and self.current_node != event.node:
                self.tracker.on_node_done(self.current_node)
            self.current_node = event.node
            await self.listener.node(event.node)
        elif kind == "execution_cached":
            # Nodes served from ComfyUI's cache are done before anything runs.
            for node in data.get("nodes") or []:
                self.tracker.on_node_done(str(node))
            await self.listener.moved()
        elif kind == "progress":
            if self.tracker.on_progress(event.node, int(data.get("value", 0))):
                await self.listener.moved()
        elif kind == "executed":
            node = event.node or ""
            self.tracker.on_node_done(node)
            output = data.get("output")
            await self.listener.executed(node, output if isinstance(output, dict) else {})
        elif kind == "execution_success":
            self.ended = "success"
        elif kind in ("execution_error", "execution_interrupted"):
            self.ended = "error" if kind == "execution_error" else "interrupted"
            self.end_data = dict(data)

    async def _reconcile(self) -> None:
        """Ask ComfyUI where the prompt is (protocol/comfyui/whereabouts.py). Only when it
        knows it nowhere, twice, is it lost: a prompt is briefly in neither its queue nor its
        history as it finishes."""
        for look in range(2):
            found = await whereabouts(self.client, self.prompt_id)
            self.last_contact = time.monotonic()
            if found.where == "pending":
                await self._set_stage("queued", found.position)
                return
            if found.where == "running":
                await self._set_stage("running")
                return
            if found.entry is not None:
                self.entry = found.entry
                self.ended = self.ended or "history"
                return
            if look == 0:
                await asyncio.sleep(LOST_RECHECK_S)
        raise PromptLost(
            f"prompt {self.prompt_id} is neither queued, running nor in history: "
            "ComfyUI lost it (restarted?)"
        )


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
