"""The orchestrator's side of following a ComfyUI prompt: the follow activity.

`follow_prompt` is the one long-running activity of a job. The protocol itself (socket before
POST, submit unless known, reconcile on silence, reopen a deaf socket, lost-prompt rechecks) is
`protocol.comfyui.follower.PromptFollower`, shared with the RunPod handler; `FollowAttempt` is
this side's listener: it heartbeats a `FollowHeartbeat` (its `Checkpoint` and the artifacts
stored so far) on every event, uploads each output as its node finishes (offload.py's
`OutputUploader`), and tells the workflow about progress with `progress` signals on milestones
only (follow_common's `Milestones`): the steps in between reach clients through the heartbeat
(`starter.progress`). Its policy: a lost socket or an unavailable ComfyUI fails the attempt
retryably with the checkpoint (the workflow re-attaches after a durable backoff), an error or an
interrupt fails it at once, and a pool that is unhealthy or busy is not submitted to. A retried
attempt reads the last heartbeat and re-attaches to the same prompt by ID. `offload_outputs`
(offload.py) reconciles against `/history` (the source of truth) once the prompt has finished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
import websockets
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.comfyui.activities import MAX_INPUT_BYTES
from activities.comfyui.offload import OutputUploader, finished_history
from activities.comfyui.pools import ComfyPools, PoolHealth
from activities.errors import (
    execution_failure,
    fatal,
    from_comfy,
    from_storage,
    history_failure,
    retryable,
)
from activities.follow_common import (
    Milestones,
    restore_checkpoint,
    send_progress,
    with_resume_point,
    worker_identity,
)
from activities.follow_common import Stage as ReportStage
from activities.heartbeat_budget import HeartbeatBudget
from activities.live_progress import LiveProgress
from activities.orphans import prompt_tag
from activities.storage import ArtifactStore
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.events import output_files
from protocol.comfyui.follower import PromptFollower, Stage
from protocol.comfyui.history import failed_in_history, history_messages
from protocol.errors import ComfyError, PromptLost
from protocol.progress import ProgressTracker
from workflows.activity_io import FollowHeartbeat, FollowInput, FollowResult
from workflows.contracts import Artifact, Checkpoint, ProgressReport
from workflows.errors import ObjectMissing, StorageError
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

# How long the socket may stay silent before we ask /queue and /history what is going on.
# A node without a progress bar can keep a healthy socket silent for minutes.
SILENCE_CHECK_S = 5.0


class FollowAttempt:
    """One attempt at following one prompt to its end, and the follower's listener."""

    def __init__(
        self,
        req: FollowInput,
        client: ComfyClient,
        store: ArtifactStore,
        health: PoolHealth,
        budget: HeartbeatBudget,
        live: LiveProgress | None = None,
        *,
        where: str | None = None,
    ) -> None:
        self.req = req
        self.store = store
        self.live = live or LiveProgress()
        self.client = client
        self.health = health
        # What this process's health marks of the backend are kept under (the pool, or its
        # server on a pool of many).
        self.where = where or req.named_pool
        # The server of a pool of many, recorded in every checkpoint from the first.
        self.server = req.server
        heartbeat = FollowHeartbeat.from_details(activity.info().heartbeat_details)
        self.checkpoint = restore_checkpoint(heartbeat, req)
        if self.server is not None and self.checkpoint.server != self.server:
            self.checkpoint = self.checkpoint.model_copy(update={"server": self.server})
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
        poll_s = min(SILENCE_CHECK_S, timeout.total_seconds() / 3) if timeout else SILENCE_CHECK_S
        self.log = log.bind(job_id=req.job_id, prompt_id=req.prompt_id, segment=req.segment)
        self.follower = PromptFollower(
            client,
            self,
            prompt_id=req.prompt_id,
            client_id=req.client_id,
            tracker=self.tracker,
            poll_s=poll_s,
            graph=req.graph,
            extra_data=prompt_tag(req.job_id, req.segment),
            submitted=self.checkpoint.submitted_at is not None,
            first_post=req.first_post,
            log=self.log,
        )
        self.poll_s = poll_s
        # Within the heartbeat timeout with room to spare, whatever the socket does.
        self.pacer = budget.pacer(
            self._send_heartbeat, self._news, keepalive_s=0.9 * poll_s, job_id=req.job_id
        )
        # Stored outputs the workflow has not been told of (their signal fell in the quiet start).
        self.untold: list[Artifact] = []
        self.uploads: set[asyncio.Task[Artifact]] = set()
        self.scheduled: set[str] = set()  # keys of uploads started by this attempt
        # The ended prompt's history, read while its last outputs are still being stored.
        self.history: asyncio.Task[dict[str, Any]] | None = None
        self.worker_id = worker_identity()
        # The prompt's run on the GPU, as this attempt sees it, on this worker's monotonic clock
        # (what the tenant's budget counts: `Checkpoint.ran_s`): from when the follower first
        # saw it running to its end, added to what earlier attempts measured.
        self.ran_before_s = self.checkpoint.ran_s
        self.running_since: float | None = None
        self.ran_until: float | None = None

    async def run(self, *, read_history: bool = False) -> FollowResult:
        """Follow the prompt to its end and store its outputs. `read_history`: once the prompt
        has ended, begin reading its history (`history`, for `offload_outputs` to confirm the
        outputs by) while the last uploads finish, not after; the caller awaits or drops it."""
        attempt = activity.info().attempt
        self.log.info("follow_start", attempt=attempt, resumed_step=self.tracker.step)
        with self.pacer, self.live.following(self.req.job_id, self._live_beat):
            quiet_end = asyncio.create_task(self._after_quiet_start())
            try:
                return await self._follow(read_history)
            finally:
                quiet_end.cancel()

    async def _follow(self, read_history: bool) -> FollowResult:
        stored = False
        try:
            if self.req.graph is not None and not self.follower.submitted:
                await self._refuse_a_bad_pool()
            seen = await self.follower.follow()
            self.ran_until = time.monotonic()
            await self._raise_unless_success(seen)
            if read_history:
                # A short job's last upload is still in flight when its prompt ends.
                self.history = asyncio.create_task(
                    finished_history(self.client, self.req.prompt_id)
                )
            await self._drain_uploads()
            stored = True
        except (OSError, websockets.exceptions.WebSocketException) as exc:
            lost = f"ComfyUI socket lost: {type(exc).__name__}: {exc}"
            failure = retryable(ErrorType.CONNECTION_LOST, lost)
            raise with_resume_point(failure, self._resume_point) from exc
        except ComfyError as exc:
            failure = from_comfy(exc, "following the prompt")
            raise with_resume_point(failure, self._resume_point) from exc
        except PromptLost as exc:
            raise from_comfy(exc, "following the prompt") from None
        except ApplicationError as exc:
            if exc.type == ErrorType.BACKEND_FAULT:
                self.health.mark_unhealthy(self.where, exc.message)
            raise with_resume_point(exc, self._resume_point) from None
        finally:
            for task in self.uploads:
                task.cancel()
            if not stored:
                self.drop_history()
        self.tracker.complete()
        # No heartbeat and no "finished" signal: the result tells the workflow the same, a round
        # trip sooner.
        return FollowResult(
            prompt_id=self.req.prompt_id,
            outcome="success",
            artifacts=list(self.uploader.artifacts.values()),
            checkpoint=self._checkpoint(),
            worker_id=self.worker_id,
        )

    def drop_history(self) -> None:
        """Cancel the history read nobody will await (its failure is then never reported)."""
        if self.history is not None and not self.history.done():
            self.history.cancel()
        elif self.history is not None and not self.history.cancelled():
            self.history.exception()  # read: not reported as never retrieved

    async def _refuse_a_bad_pool(self) -> None:
        """Nothing is submitted to a pool that is unhealthy (until a probe prompt succeeds) or
        busy (a stop that outlived its horizon still holds it)."""
        where = self.where
        unhealthy = await self.health.probe(where, self.client)
        if unhealthy is not None:
            raise retryable(
                ErrorType.BACKEND_UNAVAILABLE, f"pool {where!r} is unhealthy: {unhealthy}"
            )
        busy = await self.health.busy(where, self.client)
        if busy is not None:
            raise retryable(ErrorType.BACKEND_UNAVAILABLE, f"pool {where!r} is busy: {busy}")
        await self._upload_staged_inputs()

    async def _upload_staged_inputs(self) -> None:
        """A pool of many servers: the job's input files, staged in the bucket by its prepare
        (which ran before the queue chose the server), go to this server under the names its
        graph was bound to, before the prompt that reads them. Again on each attempt before a
        submission: an upload of the same bytes under the same name changes nothing."""
        bucket = self.req.output.bucket or self.store.settings.bucket
        for stored_as, key in self.req.staged_inputs.items():
            try:
                data = await self.store.read_bytes(key, limit=MAX_INPUT_BYTES, bucket=bucket)
            except ObjectMissing as exc:
                raise fatal(
                    ErrorType.MISSING_INPUT, f"input {stored_as!r}: its staged copy is gone: {exc}"
                ) from exc
            except StorageError as exc:
                raise from_storage(exc, f"reading staged input {stored_as!r}") from exc
            await self.client.upload_image(stored_as, data)
        if self.req.staged_inputs:
            self.log.info("inputs_uploaded", server=self.server, inputs=len(self.req.staged_inputs))

    async def _raise_unless_success(self, seen: str) -> None:
        """An error or an interrupt fails the job at once; a history entry that says it failed
        does too; one that says it succeeded names the outputs to store."""
        data = self.follower.end_data
        if seen == "error":
            raise execution_failure(data)
        if seen == "interrupted":
            raise fatal(ErrorType.INTERRUPTED, f"prompt interrupted at node {data.get('node_id')}")
        entry = self.follower.entry
        if seen == "history" and entry is not None:
            if failed_in_history(entry):
                raise history_failure(history_messages(entry))
            await self.follower.ending()

    # --- the follower's listener -------------------------------------------------------------

    async def submitted(self) -> None:
        self.checkpoint = self.checkpoint.model_copy(update={"submitted_at": datetime.now(UTC)})
        self.beat(now=True)

    async def stage(self, stage: Stage, position: int | None) -> None:
        if stage == "running" and self.running_since is None:
            self.running_since = time.monotonic()
        # Clients see the new stage (or place) at once, in the heartbeat: during the quiet start
        # it is the only way they see it, and a prompt may end before its next paced beat.
        self.beat(now=True)
        # A stage change is a milestone; so is a new place in the queue, which only the
        # workflow's status carries (at most once per silence check while queued).
        await self._signal(stage, force=True)

    async def node(self, node: str) -> None:
        await self._signal("running")

    async def moved(self) -> None:
        await self._signal("running")

    async def executed(self, node: str, output: dict[str, Any]) -> None:
        self._start_uploads({node: output})

    async def outputs(self, outputs: dict[str, Any]) -> None:
        self._start_uploads(outputs)

    def beat(self, *, now: bool = False) -> None:
        """The worker's heartbeat budget decides when this reaches the server
        (activities/heartbeat_budget.py); `now`: what the workflow must not miss. A gateway
        subscribed to the job's live progress hears of it at once (activities/live_progress.py).
        """
        self.live.moved(self.req.job_id)
        self.pacer.beat(now=now)

    def check(self) -> None:
        # Frames of other prompts keep the loop busy without a beat of ours: a sign of life.
        self.pacer.beat()
        self._fail_if_upload_failed()
        if activity.is_worker_shutdown():
            raise retryable(ErrorType.CONNECTION_LOST, "worker shutting down")

    # --- outputs -----------------------------------------------------------------------------

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
        # Paced like a step: a retry that never heard of it stores the same bytes under the same
        # key again, which costs an upload, not a wrong result.
        self.beat()
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
            self.beat()
            if done:
                self._fail_if_upload_failed()

    # --- what the workflow hears -------------------------------------------------------------

    def ran_s(self) -> float:
        """How long the prompt has run on the GPU, by this attempt's count and the earlier's."""
        if self.running_since is None:
            return self.ran_before_s
        until = self.ran_until if self.ran_until is not None else time.monotonic()
        return round(self.ran_before_s + max(until - self.running_since, 0.0), 3)

    def _checkpoint(self) -> Checkpoint:
        return self.checkpoint.model_copy(
            update={
                "ran_s": self.ran_s(),
                "step": self.tracker.step,
                "total_steps": self.tracker.total,
                "node_steps": dict(self.tracker.node_steps),
                "nodes_done": list(self.tracker.nodes_done),
                "uploaded": sorted(self.uploader.artifacts),
                "updated_at": datetime.now(UTC),
            }
        )

    def _resume_point(self) -> FollowHeartbeat:
        follower = self.follower
        return FollowHeartbeat(
            checkpoint=self._checkpoint(),
            artifacts=list(self.uploader.artifacts.values()),
            stage=follower.stage,
            queue_position=follower.queue_position if follower.stage == "queued" else None,
            live=self.live.url,
        )

    def _live_beat(self) -> FollowHeartbeat:
        """What a live-progress subscriber is pushed: the heartbeat without its artifacts
        (clients read those from the job's status)."""
        follower = self.follower
        return FollowHeartbeat(
            checkpoint=self._checkpoint(),
            stage=follower.stage,
            queue_position=follower.queue_position if follower.stage == "queued" else None,
        )

    def _send_heartbeat(self) -> None:
        activity.heartbeat(self._resume_point().model_dump(mode="json"))

    def _news(self) -> tuple[object, ...]:
        """What a heartbeat would carry that a client or the next attempt cares about."""
        follower, tracker = self.follower, self.tracker
        return (
            tracker.step,
            len(tracker.nodes_done),
            follower.stage,
            follower.queue_position,
            len(self.uploader.artifacts),
            self.checkpoint.submitted_at,
        )

    async def _after_quiet_start(self) -> None:
        """Tell the workflow what came up during the attempt's quiet start, once it is over."""
        await asyncio.sleep(self.milestones.quiet_left_s)
        stage = self.follower.stage
        if not self.milestones.held or stage is None:
            return  # nothing came up, or nothing to say yet: the next event is the first report
        if not self.untold:
            await self._signal(stage)
        while self.untold and self.follower.ended is None:
            await self._signal("uploading", artifact=self.untold.pop(0), force=True)

    async def _signal(
        self, stage: ReportStage, *, artifact: Artifact | None = None, force: bool = False
    ) -> None:
        """A `progress` signal, if this is a milestone (every step is in the heartbeats).

        Once the prompt has ended, the activity's result is the next thing the workflow hears:
        an artifact stored meanwhile is told there, not by a signal on the job's critical path
        (one that could also land after the result)."""
        follower = self.follower
        if follower.ended is not None:
            return
        # Milestones follow the prompt's stage on the backend; "uploading" only labels the
        # report of an artifact (forced), and the workflow reads it as running.
        where = "finished" if stage == "finished" else follower.stage or stage
        if not self.milestones.due(where, self.tracker.step, self.tracker.total, force=force):
            if artifact is not None and self.milestones.held:
                self.untold.append(artifact)
            return
        report = ProgressReport(
            attempt_client_id=self.req.client_id,
            stage=stage,
            queue_position=follower.queue_position if stage == "queued" else None,
            step=self.tracker.step,
            total_steps=self.tracker.total,
            node=follower.current_node,
            artifact=artifact,
            checkpoint=self._checkpoint(),
            worker_id=self.worker_id,
            # The workflow left the check to this follow and learns the pool from it.
            pool=self.req.pool if self.req.prepare is not None else None,
            kind="comfyui" if self.req.prepare is not None else None,
            slot=self.req.slot_bound,
        )
        await send_progress(self.req.job_id, report, self.log)


@dataclass(frozen=True)
class FollowActivities:
    pools: ComfyPools
    store: ArtifactStore
    budget: HeartbeatBudget
    live: LiveProgress | None = None

    async def follow_prompt(self, req: FollowInput) -> FollowResult:
        return await self.attempt(req).run()

    def attempt(self, req: FollowInput) -> FollowAttempt:
        """An attempt to run; its `uploader` says afterwards what it stored. On a pool of many
        servers, the server is where an earlier attempt sent the prompt (its checkpoint), else
        the one the job's grant named."""
        heartbeat = FollowHeartbeat.from_details(activity.info().heartbeat_details)
        server = restore_checkpoint(heartbeat, req).server or req.server
        client = self.pools.client(req.named_pool, server)
        if server != req.server:
            req = req.model_copy(update={"server": server})
        where = self.pools.health_key(req.named_pool, client)
        return FollowAttempt(
            req, client, self.store, self.pools.health, self.budget, self.live, where=where
        )
