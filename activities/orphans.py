"""The orphan sweep: work still on a pool whose job is over.

`temporal workflow terminate` (or a run timeout) ends a job without its teardown: the prompt
keeps the GPU busy and nobody is left to stop it. Each worker periodically looks for such work
on every pool it serves and stops what belongs to a workflow that is closed or unknown to
Temporal; workflows still running are left alone, and so is everything of other namespaces or
of other systems. Running it on several workers is harmless: every action is idempotent.

- ComfyUI pools: every prompt this system submits carries a tag in ComfyUI's `extra_data` (the
  job id and the Temporal namespace); the sweep lists each pool's queue, asks Temporal about each
  tagged prompt's job, and lists the queue again: a prompt still there after its job was seen
  closed is dequeued if pending or interrupted if running (prompt-scoped, so nothing else is
  touched). A prompt that ended between the two listings ended with its job. The jobs this
  worker follows itself are running and are not asked about.
- RunPod pools: RunPod cannot list an endpoint's jobs, so the follow records each submission in
  the bucket (`activities/runpod/submissions.py`); the sweep reads those records, finds the
  RunPod job (the record's id; with claims, also the claim's holder, which names the job even
  when `/run`'s answer was lost), cancels it unless it has ended, and drops the record once
  RunPod says it has ended or no longer knows it.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import structlog
from pydantic import BaseModel
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.runpod import submissions
from activities.runpod.claims import read_claim
from activities.runpod.client import RunPodClient
from activities.runpod.submissions import SubmissionRecord
from activities.storage import ArtifactStore
from configuration.pools import PoolConfig
from protocol.comfyui.client import ComfyClient
from protocol.errors import ComfyError
from workflows.errors import RunPodError, RunPodJobGone, StorageError

log = structlog.get_logger(__name__)

TAG_KEY = "durable_comfy"


def prompt_tag(job_id: str, segment: int) -> dict[str, Any]:
    """The `extra_data` every prompt is submitted with: whose it is."""
    namespace = activity.info().namespace if activity.in_activity() else ""
    return {TAG_KEY: {"job_id": job_id, "segment": segment, "namespace": namespace}}


SweepAction = Literal["dequeued", "interrupted", "cancelled"]


class SweptPrompt(BaseModel):
    pool: str
    prompt_id: str
    job_id: str
    job: str  # the workflow's status, or "unknown"
    # "cancelled": a RunPod job (`provider_job_id`), cancelled through RunPod's API.
    action: SweepAction
    provider_job_id: str | None = None


@dataclass(frozen=True)
class RunPodSweep:
    """What the sweep needs for the RunPod pools: each pool's settings and client, and the
    bucket its submissions are recorded in."""

    store: ArtifactStore
    pools: Mapping[str, tuple[PoolConfig, RunPodClient]]


class OrphanSweeper:
    """Stops the work of closed or unknown jobs on every pool of this worker."""

    def __init__(
        self,
        temporal: Client,
        pools: Mapping[str, Sequence[ComfyClient]],
        *,
        runpod: RunPodSweep | None = None,
        on_swept: Callable[[SweptPrompt], None] | None = None,
        followed_here: Callable[[str], bool] = lambda _job_id: False,
    ) -> None:
        self._temporal = temporal
        # A job whose prompt this worker follows now is running: its follow activity is. Not
        # asked about, which spares Temporal a describe per prompt per sweep; should its
        # workflow be closed, the follow learns it at its next heartbeat and ends, and the next
        # sweep asks.
        self._followed_here = followed_here
        self._pools = pools
        self._runpod = runpod
        self._on_swept = on_swept
        # Records already logged as unresolvable (logged once, not every sweep).
        self._told: set[str] = set()

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        """Sweep every `interval_s` (jittered, so many workers do not sweep in step)."""
        while not stop.is_set():
            try:
                await self.sweep_once()
            except Exception:  # a sweep must never take the worker down
                log.exception("orphan_sweep_failed")
            delay = interval_s * random.uniform(0.75, 1.25)
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def sweep_once(self) -> list[SweptPrompt]:
        swept: list[SweptPrompt] = []
        for pool, clients in self._pools.items():
            for client in clients:
                try:
                    swept += await self._sweep_pool(pool, client)
                except ComfyError as exc:
                    log.info(
                        "orphan_sweep_pool_unreachable",
                        pool=pool,
                        server=client.base_url,
                        error=str(exc),
                    )
        if self._runpod is not None:
            for pool, (config, runpod) in self._runpod.pools.items():
                try:
                    swept += await self._sweep_runpod_pool(pool, config, runpod, self._runpod.store)
                except (StorageError, RPCError) as exc:
                    log.info("orphan_sweep_pool_unreachable", pool=pool, error=str(exc))
        return swept

    async def _sweep_pool(self, pool: str, client: ComfyClient) -> list[SweptPrompt]:
        closed: dict[str, tuple[str, str]] = {}  # prompt id -> (job id, the job's status)
        for item in _queued(await client.queue()):
            job_id = self._our_job(item)
            if job_id is None or self._followed_here(job_id):
                continue
            job = await self._job_state(job_id)
            if job != "RUNNING":
                closed[str(item[1])] = (job_id, job)
        if not closed:
            return []
        # The listing is older than the statuses: a job whose prompt ended between the two
        # completed with it, and is no orphan. A prompt still on the queue after its job was
        # seen closed is one; and where it is now says whether to dequeue or interrupt it.
        listed = await client.queue()
        swept: list[SweptPrompt] = []
        for where in ("queue_running", "queue_pending"):
            for item in listed.get(where, []):
                prompt_id = str(item[1])
                if prompt_id not in closed:
                    continue
                job_id, job = closed.pop(prompt_id)
                if where == "queue_pending":
                    await client.delete_pending(prompt_id)
                    action: Literal["dequeued", "interrupted"] = "dequeued"
                else:
                    await client.interrupt(prompt_id)
                    action = "interrupted"
                orphan = SweptPrompt(
                    pool=pool, prompt_id=prompt_id, job_id=job_id, job=job, action=action
                )
                swept.append(self._swept(orphan))
        return swept

    async def work_left(self, pool: str, job_ids: set[str]) -> set[str]:
        """The jobs among `job_ids` (closed ones) whose work may still be on `pool`: a prompt
        tagged with the job still on a ComfyUI pool's queue, a submission record the sweep has
        not dropped on a RunPod pool (it drops one once RunPod says its job ended). A pool this
        worker does not serve: all of them (nothing here can tell)."""
        clients = self._pools.get(pool)
        if clients is not None:
            # Every server of the pool (a server that cannot be asked fails the look: asked
            # again at the next).
            queued: set[str | None] = set()
            for client in clients:
                queued |= {self._our_job(item) for item in _queued(await client.queue())}
            return job_ids & {job for job in queued if job is not None}
        if self._runpod is not None and pool in self._runpod.pools:
            recorded = {job for _key, job in await submissions.listed(self._runpod.store, pool)}
            return job_ids & recorded
        return set(job_ids)

    def _swept(self, orphan: SweptPrompt) -> SweptPrompt:
        log.warning("orphan_swept", **orphan.model_dump())
        if self._on_swept is not None:
            self._on_swept(orphan)
        return orphan

    async def _sweep_runpod_pool(
        self, pool: str, config: PoolConfig, client: RunPodClient, store: ArtifactStore
    ) -> list[SweptPrompt]:
        swept: list[SweptPrompt] = []
        for key, job_in_key in await submissions.listed(store, pool):
            # A live job's record is not even read: its workflow is still running.
            job = await self._job_state(job_in_key)
            if job == "RUNNING":
                continue
            try:
                record = await submissions.read_record(store, key)
            except ValueError as exc:
                self._tell_once(key, "orphan_record_unreadable", record=key, error=str(exc))
                continue
            ours = record is not None and record.namespace == self._temporal.namespace
            if record is None or not ours or record.endpoint_id != config.endpoint_id:
                continue
            if record.job_id != job_in_key:  # (an id the key had to sanitise)
                job = await self._job_state(record.job_id)
                if job == "RUNNING":
                    continue
            try:
                swept += await self._stop_submission(pool, key, record, job, client, store)
            except RunPodError as exc:
                log.info("orphan_runpod_unreachable", pool=pool, key=key, error=str(exc))
        return swept

    async def _stop_submission(
        self,
        pool: str,
        key: str,
        record: SubmissionRecord,
        job: str,
        client: RunPodClient,
        store: ArtifactStore,
    ) -> list[SweptPrompt]:
        """Cancel the RunPod job(s) of one submission whose workflow is over; drop the record
        once none of them can still run."""
        candidates = [record.runpod_job_id] if record.runpod_job_id else []
        if record.claims:
            claim = await read_claim(store, record.output, record.job_id, record.submission)
            if claim is not None and claim.holder not in candidates:
                candidates.append(claim.holder)
        if not candidates:
            # `/run`'s answer was lost and no worker has claimed it (or there are no claims):
            # nothing names the RunPod job. Once its ttl is over none can exist.
            if datetime.now(UTC) > record.expires_at:
                await store.delete(key)
            else:
                self._tell_once(key, "orphan_runpod_job_unknown", job_id=record.job_id, record=key)
            return []
        swept: list[SweptPrompt] = []
        settled = True
        for runpod_job_id in candidates:
            try:
                state = (await client.status(runpod_job_id)).state
                if state is not None and state.terminal:
                    continue
                await client.cancel(runpod_job_id)
                swept.append(
                    self._swept(
                        SweptPrompt(
                            pool=pool,
                            prompt_id=record.submission,
                            job_id=record.job_id,
                            job=job,
                            action="cancelled",
                            provider_job_id=runpod_job_id,
                        )
                    )
                )
                state = (await client.status(runpod_job_id)).state
                settled = settled and state is not None and state.terminal
            except RunPodJobGone:
                continue
        if settled:
            await store.delete(key)
        return swept

    def _tell_once(self, key: str, event: str, **fields: Any) -> None:
        if key not in self._told:
            self._told.add(key)
            log.info(event, **fields)

    def _our_job(self, item: list[Any]) -> str | None:
        extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
        tag = extra.get(TAG_KEY)
        if not isinstance(tag, dict) or tag.get("namespace") != self._temporal.namespace:
            return None
        job_id = tag.get("job_id")
        return job_id if isinstance(job_id, str) and job_id else None

    async def _job_state(self, job_id: str) -> str:
        """The workflow's status name; "unknown" when Temporal has no such workflow."""
        try:
            described = await self._temporal.get_workflow_handle(job_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return "unknown"
            raise
        status = described.status
        if status is None:
            return "unknown"
        return "RUNNING" if status == WorkflowExecutionStatus.RUNNING else status.name


def _queued(queue: Mapping[str, Any]) -> list[list[Any]]:
    """The items of a ComfyUI `/queue` answer, running ones first."""
    return [*queue.get("queue_running", []), *queue.get("queue_pending", [])]
