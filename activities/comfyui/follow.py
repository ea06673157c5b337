"""Following a running ComfyUI prompt, and storing its outputs in S3 as they appear.

`follow_prompt` is the one long-running activity of a job: it opens the prompt's WebSocket,
submits the prompt when asked to (socket first, so not even the first node's events are missed),
heartbeats a `FollowHeartbeat` (its `Checkpoint` and the artifacts stored so far) on every event,
uploads each output as its node finishes (offload.py's `OutputUploader`), and tells the workflow
about progress with `progress` signals on milestones only (follow_common's `Milestones`): the
steps in between reach clients through the heartbeat (`starter.progress`). A retried attempt
reads the last heartbeat and re-attaches to the same prompt by ID; it submits only when asked to
and the backend has never heard of the prompt. `offload_outputs` (offload.py) reconciles against
`/history` (the source of truth) once the prompt has finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import structlog
import websockets
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.comfyui.client import ComfyClient, ComfyError
from activities.comfyui.events import (
    ComfyEvent,
    for_prompt,
    output_files,
    parse_frame,
)
from activities.comfyui.offload import OutputUploader
from activities.comfyui.pools import ComfyPools, PoolHealth
from activities.errors import (
    execution_failure,
    fatal,
    from_comfy,
    history_failure,
    retryable,
)
from activities.follow_common import (
    Milestones,
    Stage,
    restore_checkpoint,
    send_progress,
    worker_identity,
)
from activities.orphans import prompt_tag
from activities.progress import ProgressTracker
from activities.storage import ArtifactStore
from workflows.activity_io import FollowHeartbeat, FollowInput, FollowResult
from workflows.contracts import Artifact, Checkpoint, ProgressReport
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

# How long the socket may stay silent before we ask /queue and /history what is going on.
# A node without a progress bar can keep a healthy socket silent for minutes.
SILENCE_CHECK_S = 5.0
# A socket silent this many polls while the prompt runs is reopened: ComfyUI unregisters a
# client_id when any socket of that ID closes, so an older attempt's socket closing late can
# leave ours deaf. Reopening registers the ID again; a silent node merely costs a reconnect.
RESUBSCRIBE_AFTER_POLLS = 2
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
# Asked twice, this far apart, before a prompt counts as lost.
LOST_RECHECK_S = 1.0


class PromptFollower:
    """One attempt at following one prompt to its end."""

    def __init__(
        self, req: FollowInput, client: ComfyClient, store: ArtifactStore, health: PoolHealth
    ) -> None:
        self.req = req
        self.client = client
        self.health = health
        heartbeat = FollowHeartbeat.from_details(activity.info().heartbeat_details)
        self.checkpoint = restore_checkpoint(heartbeat, req)
        stored = list(req.stored) + (heartbeat.artifacts if heartbeat is not None else [])
        self.uploader = OutputUploader(
            client,
            store,
            job_id=req.job_id,
            segment=req.segment,
            output=req.output,
            stored=stored,
            run_tag=req.run_tag,
        )
        self.tracker = ProgressTracker(req.sampler_steps, req.nodes_total)
        self.tracker.restore(self.checkpoint.node_steps, self.checkpoint.nodes_done)
        self.milestones = Milestones(req.progress_interval_s)
        timeout = activity.info().heartbeat_timeout
        # Heartbeat well inside the timeout even while the socket is silent.
        self.poll_s = (
            min(SILENCE_CHECK_S, timeout.total_seconds() / 3) if timeout else SILENCE_CHECK_S
        )
        self.resubscribe_after_s = RESUBSCRIBE_AFTER_POLLS * self.poll_s
        self.current_node: str | None = None
        # "queued" while the prompt waits behind others on the backend, then "running".
        self.stage: Stage | None = None
        self.queue_position: int | None = None
        self.last_routed = time.monotonic()
        self.succeeded = False
        self.uploads: set[asyncio.Task[Artifact]] = set()
        self.scheduled: set[str] = set()  # keys of uploads started by this attempt
        self.log = log.bind(job_id=req.job_id, prompt_id=req.prompt_id, segment=req.segment)
        self.worker_id = worker_identity()

    async def run(self) -> FollowResult:
        attempt = activity.info().attempt
        self.log.info("follow_start", attempt=attempt, resumed_step=self.tracker.step)
        try:
            while not self.succeeded:
                await self._follow_socket()
            await self._drain_uploads()
        except (OSError, websockets.exceptions.WebSocketException) as exc:
            raise self._with_progress(
                retryable(
                    ErrorType.CONNECTION_LOST, f"ComfyUI socket lost: {type(exc).__name__}: {exc}"
                )
            ) from exc
        except ComfyError as exc:
            raise self._with_progress(from_comfy(exc, "following the prompt")) from exc
        except ApplicationError as exc:
            if exc.type == ErrorType.BACKEND_FAULT:
                self.health.mark_unhealthy(self.req.pool, exc.message)
            raise self._with_progress(exc) from None
        finally:
            for task in self.uploads:
                task.cancel()
        self.tracker.complete()
        self._heartbeat()
        # No "finished" signal: the result tells the workflow the same, a round trip sooner.
        return FollowResult(
            prompt_id=self.req.prompt_id,
            outcome="success",
            artifacts=list(self.uploader.artifacts.values()),
            checkpoint=self._checkpoint(),
        )

    async def _follow_socket(self) -> None:
        """One socket's life: reconcile, then events until the prompt ends or the socket idles.

        The submission's client_id takes the prompt's event routing over from a dead socket;
        a fresh ID would get none of the prompt's events. A socket that stays silent while the
        prompt runs is reopened, which re-registers that routing.
        """
        async with websockets.connect(
            self.client.ws_url(self.req.client_id), max_size=None, open_timeout=10
        ) as ws:
            self.last_routed = time.monotonic()
            if self.req.graph is not None and self.checkpoint.submitted_at is None:
                await self._submit(self.req.graph)
                # Nothing can have been missed on a socket opened before the submission: the
                # events (buffered if the prompt ran at once) tell the rest, not /history.
                place = await self.client.queue_place(self.req.prompt_id)
                if place.where == "pending":
                    await self._set_stage("queued", place.position)
            else:
                await self._reconcile()
            while not self.succeeded:
                if await self._next_event(ws):
                    self.last_routed = time.monotonic()
                elif (
                    self.stage == "running"
                    and time.monotonic() - self.last_routed > self.resubscribe_after_s
                ):
                    # Only a running prompt owes us events: one waiting in the queue is quiet.
                    self.log.info("socket_silent_reopening")
                    return
                self._fail_if_upload_failed()
                if activity.is_worker_shutdown():
                    raise retryable(ErrorType.CONNECTION_LOST, "worker shutting down")

    async def _submit(self, graph: dict[str, Any]) -> None:
        """POST /prompt with our prompt_id, unless the backend already has it.

        The prompt_id is ours, so an attempt after a lost answer asks `/queue`, `/history` and
        `/api/jobs` first instead of queueing (and paying for) the same work twice.
        """
        pool = self.req.pool
        unhealthy = await self.health.probe(pool, self.client)
        if unhealthy is not None:
            raise retryable(
                ErrorType.BACKEND_UNAVAILABLE, f"pool {pool!r} is unhealthy: {unhealthy}"
            )
        busy = await self.health.busy(pool, self.client)
        if busy is not None:
            raise retryable(ErrorType.BACKEND_UNAVAILABLE, f"pool {pool!r} is busy: {busy}")
        if await self._known():
            self.log.info("submit_already_known")
        else:
            answer = await self.client.post_prompt(
                graph,
                prompt_id=self.req.prompt_id,
                client_id=self.req.client_id,
                extra_data=prompt_tag(self.req.job_id, self.req.segment),
            )
            dropped = answer.get("node_errors") or {}
            if dropped:
                # ComfyUI runs the valid outputs and drops the others: say which.
                self.log.warning("outputs_dropped_by_comfyui", node_errors=dropped)
            self.log.info("submitted", number=answer.get("number"), dropped_outputs=len(dropped))
        self.checkpoint = self.checkpoint.model_copy(update={"submitted_at": datetime.now(UTC)})
        self._heartbeat()

    async def _known(self) -> bool:
        prompt_id = self.req.prompt_id
        if await self.client.queue_position(prompt_id) is not None:
            return True
        if await self.client.history(prompt_id) is not None:
            return True
        return await self.client.job_state(prompt_id) is not None

    async def _set_stage(self, stage: Stage, position: int | None = None) -> None:
        if stage == self.stage and position == self.queue_position:
            return
        if stage != self.stage:
            self.last_routed = time.monotonic()  # silence counts from the prompt's start
        self.stage, self.queue_position = stage, position
        # A stage change is a milestone; so is a new place in the queue, which only the
        # workflow's status carries (at most once per silence check while queued).
        await self._signal(stage, force=True)

    async def _next_event(self, ws: websockets.ClientConnection) -> bool:
        """Handle the next frame; True only for an event routed to our client_id."""
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel (Temporal's, the stop's)
            # that lands while a frame arrives, and a busy socket then hides it for good.
            async with asyncio.timeout(self.poll_s):
                frame = await ws.recv()
        except TimeoutError:
            self._heartbeat()
            # A silent socket on a live prompt is not a failure: ask the source of truth.
            await self._reconcile()
            return False
        event = parse_frame(frame)
        if event is None or not for_prompt(event, self.req.prompt_id):
            return False
        await self._handle(event)
        self._heartbeat()
        return event.type in ROUTED_EVENTS

    def _with_progress(self, error: ApplicationError) -> ApplicationError:
        """A retryable failure carries the checkpoint, so the workflow re-attaches from it."""
        if error.non_retryable:
            return error
        return ApplicationError(
            error.message,
            self._resume_point().model_dump(mode="json"),
            type=error.type,
            non_retryable=False,
        )

    async def _handle(self, event: ComfyEvent) -> None:
        kind, data = event.type, event.data
        if kind in ("execution_start", "execution_cached", "executing", "progress"):
            if not (kind == "executing" and event.node is None):
                await self._set_stage("running")
        if kind == "executing":
            if event.node is None and event.prompt_id == self.req.prompt_id:
                self.succeeded = True
                return
            if self.current_node is not None and self.current_node != event.node:
                self.tracker.on_node_done(self.current_node)
            self.current_node = event.node
            await self._signal("running")
        elif kind == "execution_cached":
            # Nodes served from ComfyUI's cache are done before anything runs.
            for node in data.get("nodes", []):
                self.tracker.on_node_done(str(node))
            await self._signal("running")
        elif kind == "progress":
            if self.tracker.on_progress(event.node, int(data.get("value", 0))):
                await self._signal("running")
        elif kind == "executed":
            node = event.node or ""
            self.tracker.on_node_done(node)
            self._start_uploads({node: data.get("output") or {}})
        elif kind == "execution_success":
            self.succeeded = True
        elif kind == "execution_error":
            raise execution_failure(data)
        elif kind == "execution_interrupted":
            raise fatal(ErrorType.INTERRUPTED, f"prompt interrupted at node {data.get('node_id')}")

    async def _reconcile(self) -> None:
        """Ask /queue, then /history, where the prompt is; recover what events we missed.

        Only when neither knows it (and `/api/jobs` does not either) is it lost: `{}` from
        history alone can mean queued, running, never submitted, or lost.
        """
        for look in range(2):
            place = await self.client.queue_place(self.req.prompt_id)
            if place.where == "pending":
                await self._set_stage("queued", place.position)
                return
            if place.where == "running":
                if self.stage != "running":
                    await self._set_stage("running")
                return
            entry = await self.client.history(self.req.prompt_id)
            if entry is not None:
                status = entry.get("status", {})
                if status.get("status_str") == "error":
                    raise history_failure(status.get("messages", []))
                self._start_uploads(entry.get("outputs", {}))
                self.succeeded = True
                return
            if await self.client.job_state(self.req.prompt_id) in ("pending", "in_progress"):
                return
            if look == 0:
                await asyncio.sleep(LOST_RECHECK_S)
        raise fatal(
            ErrorType.PROMPT_LOST,
            f"prompt {self.req.prompt_id} is neither queued, running nor in history: "
            "ComfyUI lost it (restarted?)",
        )

    def _start_uploads(self, outputs: dict[str, Any]) -> None:
        for node_id, item in output_files(outputs):
            key = self.uploader.key_for(node_id, item)
            # Marked when scheduled, not when the task first runs: frames already buffered
            # (a repeated `executed`) are handled before any new task gets to start.
            if self.uploader.wanted(node_id, item) and key not in self.scheduled:
                self.scheduled.add(key)
                task = asyncio.create_task(self._upload(node_id, item))
                self.uploads.add(task)

    async def _upload(self, node_id: str, item: Mapping[str, str]) -> Artifact:
        artifact = await self.uploader.upload(node_id, item)
        self._heartbeat()
        await self._signal("uploading", artifact=artifact, force=True)
        return artifact

    def _fail_if_upload_failed(self) -> None:
        for task in [t for t in self.uploads if t.done()]:
            self.uploads.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise error

    async def _drain_uploads(self) -> None:
        while self.uploads:
            # Within the heartbeat timeout, however short the job set it.
            done, _pending = await asyncio.wait(self.uploads, timeout=self.poll_s)
            self._heartbeat()
            if done:
                self._fail_if_upload_failed()

    def _checkpoint(self) -> Checkpoint:
        return self.checkpoint.model_copy(
            update={
                "step": self.tracker.step,
                "total_steps": self.tracker.total,
                "node_steps": dict(self.tracker.node_steps),
                "nodes_done": list(self.tracker.nodes_done),
                "uploaded": sorted(self.uploader.artifacts),
                "updated_at": datetime.now(UTC),
            }
        )

    def _resume_point(self) -> FollowHeartbeat:
        return FollowHeartbeat(
            checkpoint=self._checkpoint(), artifacts=list(self.uploader.artifacts.values())
        )

    def _heartbeat(self) -> None:
        activity.heartbeat(self._resume_point().model_dump(mode="json"))

    async def _signal(
        self, stage: Stage, *, artifact: Artifact | None = None, force: bool = False
    ) -> None:
        """A `progress` signal, if this is a milestone (every step is in the heartbeats).

        Once the prompt has ended, the activity's result is the next thing the workflow hears:
        an artifact stored meanwhile is told there, not by a signal on the job's critical path
        (one that could also land after the result)."""
        if self.succeeded:
            return
        # Milestones follow the prompt's stage on the backend; "uploading" only labels the
        # report of an artifact (forced), and the workflow reads it as running.
        where = "finished" if stage == "finished" else self.stage or stage
        if not self.milestones.due(where, self.tracker.step, self.tracker.total, force=force):
            return
        report = ProgressReport(
            attempt_client_id=self.req.client_id,
            stage=stage,
            queue_position=self.queue_position if stage == "queued" else None,
            step=self.tracker.step,
            total_steps=self.tracker.total,
            node=self.current_node,
            artifact=artifact,
            checkpoint=self._checkpoint(),
            worker_id=self.worker_id,
        )
        await send_progress(self.req.job_id, report, self.log)


class FollowActivities:
    def __init__(self, pools: ComfyPools, store: ArtifactStore) -> None:
        self._pools = pools
        self._store = store

    async def follow_prompt(self, req: FollowInput) -> FollowResult:
        client = self._pools.client(req.pool)
        return await PromptFollower(req, client, self._store, self._pools.health).run()
