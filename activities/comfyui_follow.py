"""Following a running ComfyUI prompt, and offloading its outputs to S3 as they appear.

`follow_prompt` is the one long-running activity of a job: it listens on the prompt's WebSocket,
heartbeats a `Checkpoint` on every event, uploads each output as its node finishes, and tells the
workflow about progress with throttled signals. A retried attempt reads the last checkpoint and
re-attaches to the same prompt by ID; it never submits anything. `offload_outputs` reconciles
against `/history` (the source of truth) once the prompt has finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

import structlog
import websockets
from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.comfy_client import ComfyClient, ComfyError
from activities.comfy_events import (
    ComfyEvent,
    for_prompt,
    is_fatal_device_error,
    is_out_of_memory,
    output_files,
    parse_frame,
)
from activities.comfyui import ComfyPools
from activities.errors import fatal, from_comfy, from_storage, retryable
from activities.keys import artifact_key, content_type_for
from activities.progress import ProgressTracker
from activities.storage import ArtifactStore, StorageError
from workflows.activity_io import FollowInput, FollowResult, OffloadInput, OffloadResult
from workflows.contracts import Artifact, Checkpoint, OutputSpec, ProgressReport
from workflows.shared import SIGNAL_PROGRESS, ErrorType

log = structlog.get_logger(__name__)

Stage = Literal["queued", "running", "uploading", "finished"]

# How long the socket may stay silent before we ask /queue and /history what is going on.
# A node without a progress bar can keep a healthy socket silent for minutes.
SILENCE_CHECK_S = 5.0
MAX_PARALLEL_UPLOADS = 2


class OutputUploader:
    """Streams ComfyUI output files (`/view`) into S3, each file at most once."""

    def __init__(
        self,
        client: ComfyClient,
        store: ArtifactStore,
        *,
        job_id: str,
        segment: int,
        output: OutputSpec,
        stored: list[Artifact],
        run_tag: str,
    ) -> None:
        self._run_tag = run_tag
        self._client = client
        self._store = store
        self._job_id = job_id
        self._segment = segment
        self._output = output
        self.artifacts: dict[str, Artifact] = {a.key: a for a in stored}
        self._in_flight: set[str] = set()
        self._limit = asyncio.Semaphore(MAX_PARALLEL_UPLOADS)

    def key_for(self, node_id: str, item: Mapping[str, str]) -> str:
        return artifact_key(
            self._output.prefix, self._job_id, self._segment, node_id, item["filename"]
        )

    def wanted(self, node_id: str, item: Mapping[str, str]) -> bool:
        """Only saved outputs are artifacts; previews (`temp`) are not kept."""
        if item.get("type", "output") != "output":
            return False
        key = self.key_for(node_id, item)
        return key not in self.artifacts and key not in self._in_flight

    async def upload(self, node_id: str, item: Mapping[str, str]) -> Artifact:
        if not _from_this_run(item, self._run_tag):
            raise fatal(
                ErrorType.OUTPUT_MISSING,
                f"output {item.get('filename')!r} of node {node_id} is not from this run "
                f"(expected subfolder under {self._run_tag!r}): ComfyUI served a cached result",
            )
        key = self.key_for(node_id, item)
        self._in_flight.add(key)
        try:
            async with self._limit:
                content_type = content_type_for(item["filename"])
                async with self._client.view(
                    item["filename"], item.get("subfolder", ""), item.get("type", "output")
                ) as chunks:
                    stored = await self._store.upload_stream(
                        key, chunks, content_type=content_type, bucket=self._output.bucket
                    )
        except ComfyError as exc:
            raise from_comfy(exc, f"fetching output {item['filename']!r}") from exc
        except StorageError as exc:
            raise from_storage(exc, f"storing {key}") from exc
        finally:
            self._in_flight.discard(key)
        artifact = Artifact(
            key=stored.key,
            uri=stored.uri,
            size=stored.size,
            sha256=stored.sha256,
            content_type=stored.content_type,
            node_id=node_id,
            segment=self._segment,
        )
        self.artifacts[key] = artifact
        log.info("artifact_stored", job_id=self._job_id, key=key, size=stored.size)
        return artifact


class PromptFollower:
    """One attempt at following one prompt to its end."""

    def __init__(self, req: FollowInput, client: ComfyClient, store: ArtifactStore) -> None:
        self.req = req
        self.client = client
        details = activity.info().heartbeat_details
        self.checkpoint = _restore_checkpoint(details, req)
        stored = list(req.stored) + _restore_artifacts(details)
        self.uploader = OutputUploader(
            client,
            store,
            job_id=req.job_id,
            segment=req.segment,
            output=req.output,
            stored=stored,
            run_tag=req.run_tag,
        )
        self.tracker = ProgressTracker(
            req.sampler_steps, req.nodes_total, min_interval_s=min(1.0, req.progress_interval_s)
        )
        self.tracker.restore(self.checkpoint.node_steps, self.checkpoint.nodes_done)
        self.current_node: str | None = None
        self.succeeded = False
        self.uploads: set[asyncio.Task[Artifact]] = set()
        self.log = log.bind(job_id=req.job_id, prompt_id=req.prompt_id, segment=req.segment)

    async def run(self) -> FollowResult:
        attempt = activity.info().attempt
        self.log.info("follow_start", attempt=attempt, resumed_step=self.tracker.step)
        try:
            # The same client_id takes the prompt's event routing over from a dead socket.
            async with websockets.connect(
                self.client.ws_url(self.req.client_id), max_size=None, open_timeout=10
            ) as ws:
                await self._reconcile()
                while not self.succeeded:
                    await self._next_event(ws)
                    self._fail_if_upload_failed()
            await self._drain_uploads()
        except (OSError, websockets.exceptions.WebSocketException) as exc:
            raise retryable(
                ErrorType.CONNECTION_LOST,
                f"ComfyUI socket lost: {type(exc).__name__}: {exc}",
            ) from exc
        except ComfyError as exc:
            raise from_comfy(exc, "following the prompt") from exc
        finally:
            for task in self.uploads:
                task.cancel()
        self.tracker.complete()
        self._heartbeat()
        await self._signal("finished", force=True)
        return FollowResult(
            prompt_id=self.req.prompt_id,
            outcome="success",
            artifacts=list(self.uploader.artifacts.values()),
            checkpoint=self._checkpoint(),
        )

    async def _next_event(self, ws: websockets.ClientConnection) -> None:
        try:
            frame = await asyncio.wait_for(ws.recv(), timeout=SILENCE_CHECK_S)
        except TimeoutError:
            self._heartbeat()
            if activity.is_worker_shutdown():
                raise retryable(ErrorType.CONNECTION_LOST, "worker shutting down") from None
            # A silent socket on a live prompt is not a failure: ask the source of truth.
            await self._reconcile()
            return
        event = parse_frame(frame)
        if event is None or not for_prompt(event, self.req.prompt_id):
            return
        await self._handle(event)
        self._heartbeat()

    async def _handle(self, event: ComfyEvent) -> None:
        kind, data = event.type, event.data
        if kind == "executing":
            if event.node is None and event.prompt_id == self.req.prompt_id:
                self.succeeded = True
                return
            if self.current_node is not None and self.current_node != event.node:
                self.tracker.on_node_done(self.current_node)
            self.current_node = event.node
            await self._signal("running")
        elif kind == "execution_cached":
            for node in data.get("nodes", []):
                self.tracker.on_node_done(str(node))
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
            raise _execution_error(data)
        elif kind == "execution_interrupted":
            raise fatal(ErrorType.INTERRUPTED, f"prompt interrupted at node {data.get('node_id')}")

    async def _reconcile(self) -> None:
        """Ask /queue, then /history, where the prompt is; recover what events we missed."""
        position = await self.client.queue_position(self.req.prompt_id)
        if position is not None:
            return
        entry = await self.client.history(self.req.prompt_id)
        if entry is None:
            raise fatal(
                ErrorType.PROMPT_LOST,
                f"prompt {self.req.prompt_id} is neither queued, running nor in history: "
                "ComfyUI lost it (restarted?)",
            )
        status = entry.get("status", {})
        if status.get("status_str") == "error":
            raise _history_error(status.get("messages", []))
        self._start_uploads(entry.get("outputs", {}))
        self.succeeded = True

    def _start_uploads(self, outputs: dict[str, Any]) -> None:
        for node_id, item in output_files(outputs):
            if self.uploader.wanted(node_id, item):
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
            done, _pending = await asyncio.wait(self.uploads, timeout=SILENCE_CHECK_S)
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
                "last_artifact_ref": max(self.uploader.artifacts, default=None),
                "updated_at": datetime.now(UTC),
            }
        )

    def _heartbeat(self) -> None:
        artifacts = [a.model_dump(mode="json") for a in self.uploader.artifacts.values()]
        activity.heartbeat(self._checkpoint().model_dump(mode="json"), artifacts)

    async def _signal(
        self, stage: Stage, *, artifact: Artifact | None = None, force: bool = False
    ) -> None:
        if not self.tracker.should_signal(force=force):
            return
        report = ProgressReport(
            attempt_client_id=self.req.client_id,
            stage=stage,
            step=self.tracker.step,
            total_steps=self.tracker.total,
            nodes_done=len(self.tracker.nodes_done),
            nodes_total=self.req.nodes_total,
            node=self.current_node,
            artifact=artifact,
            checkpoint=self._checkpoint(),
            worker_id=activity.info().activity_id,
        )
        try:
            handle = activity.client().get_workflow_handle(self.req.job_id)
            await handle.signal(SIGNAL_PROGRESS, report)
        except Exception as exc:  # progress is advisory: never fail the job over it
            self.log.warning("progress_signal_failed", error=str(exc))


def _restore_checkpoint(details: Any, req: FollowInput) -> Checkpoint:
    if details:
        try:
            checkpoint = Checkpoint.model_validate(details[0])
        except ValidationError:
            checkpoint = None
        if checkpoint is not None and checkpoint.prompt_id == req.prompt_id:
            return checkpoint
    return Checkpoint(
        job_id=req.job_id,
        segment=req.segment,
        prompt_id=req.prompt_id,
        client_id=req.client_id,
        updated_at=datetime.now(UTC),
    )


def _restore_artifacts(details: Any) -> list[Artifact]:
    if not details or len(details) < 2:
        return []
    try:
        return [Artifact.model_validate(a) for a in details[1]]
    except ValidationError:
        return []


def _execution_error(data: Mapping[str, Any]) -> ApplicationError:
    node = f"node {data.get('node_id')} ({data.get('node_type')})"
    message = f"{node}: {data.get('exception_type')}: {data.get('exception_message')}"
    if is_out_of_memory(dict(data)):
        return fatal(ErrorType.OUT_OF_MEMORY, f"out of GPU memory at {message}")
    if is_fatal_device_error(dict(data)):
        return fatal(ErrorType.EXECUTION_ERROR, f"unrecoverable device fault at {message}")
    return fatal(ErrorType.EXECUTION_ERROR, message)


def _history_error(messages: list[Any]) -> ApplicationError:
    for item in messages:
        if isinstance(item, list) and len(item) == 2 and item[0] == "execution_error":
            return _execution_error(item[1])
        if isinstance(item, list) and len(item) == 2 and item[0] == "execution_interrupted":
            return fatal(ErrorType.INTERRUPTED, "prompt was interrupted")
    return fatal(ErrorType.EXECUTION_ERROR, "prompt failed (history says error)")


class FollowActivities:
    def __init__(self, pools: ComfyPools, store: ArtifactStore) -> None:
        self._pools = pools
        self._store = store

    @activity.defn(name="follow_prompt")
    async def follow_prompt(self, req: FollowInput) -> FollowResult:
        return await PromptFollower(req, self._pools.client(req.pool), self._store).run()

    @activity.defn(name="offload_outputs")
    async def offload_outputs(self, req: OffloadInput) -> OffloadResult:
        """Store every saved output the history lists and verify all of them in S3."""
        client = self._pools.client(req.pool)
        uploader = OutputUploader(
            client,
            self._store,
            job_id=req.job_id,
            segment=req.segment,
            output=req.output,
            stored=list(req.stored),
            run_tag=req.run_tag,
        )
        entry = await _history_when_written(client, req.prompt_id)
        outputs = entry.get("outputs", {})
        for node_id, item in output_files(outputs):
            if not uploader.wanted(node_id, item):
                continue
            await uploader.upload(node_id, item)
            activity.heartbeat()
        for artifact in uploader.artifacts.values():
            head = await self._store.head(artifact.key, bucket=req.output.bucket)
            if head is None or head.size != artifact.size or head.sha256 != artifact.sha256:
                raise retryable(
                    ErrorType.STORAGE_ERROR,
                    f"{artifact.uri} is not stored as stated (size {artifact.size}, "
                    f"sha256 {artifact.sha256[:12]}...)",
                )
        return OffloadResult(artifacts=sorted(uploader.artifacts.values(), key=lambda a: a.key))


def _from_this_run(item: Mapping[str, str], run_tag: str) -> bool:
    subfolder = item.get("subfolder", "")
    return subfolder == run_tag or subfolder.startswith(run_tag + "/")


async def _history_when_written(client: ComfyClient, prompt_id: str) -> dict[str, Any]:
    """`execution_success` arrives before the history entry exists: give it a moment."""
    deadline = time.monotonic() + 10.0
    try:
        while True:
            entry = await client.history(prompt_id)
            if entry is not None:
                status = entry.get("status", {})
                if status.get("status_str") == "error":
                    raise _history_error(status.get("messages", []))
                return entry
            if time.monotonic() > deadline:
                raise retryable(ErrorType.OUTPUT_MISSING, f"no history for prompt {prompt_id} yet")
            await asyncio.sleep(0.2)
    except ComfyError as exc:
        raise from_comfy(exc, "reading history") from exc
