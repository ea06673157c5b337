"""`JobClient`: submit a job, find it again by ID, follow it, fetch its artifacts.

Everything goes through the Temporal client SDK; the job's state lives in its workflow, so any
client (this one after a restart, another machine, the Temporal UI) sees the same job.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from starter.connection import connect_temporal
from starter.errors import ContactLost, JobNotFound
from workflows.backoff import reconnect_delay
from workflows.contracts import (
    Artifact,
    CancelRequest,
    JobRequest,
    JobState,
    JobStatus,
    ReconnectPolicy,
    ResumeRequest,
    validate_job_id,
)
from workflows.shared import (
    DEFAULT_TASK_QUEUE,
    QUERY_STATUS,
    SA_JOB_STATE,
    SA_TENANT,
    SIGNAL_CANCEL,
    SIGNAL_CLIENT_SEEN,
    SIGNAL_RESUME,
    UPDATE_ATTACH,
    WORKFLOW_TYPE,
)

if TYPE_CHECKING:
    from activities.storage import ArtifactStore

STATE_KEY = SearchAttributeKey.for_keyword(SA_JOB_STATE)
TENANT_KEY = SearchAttributeKey.for_keyword(SA_TENANT)


class JobClient:
    """Async client for durable-comfy jobs.

    `store` (an open `activities.storage.ArtifactStore`) is optional: with it, `result` adds
    presigned download URLs; without S3 credentials you still get `s3://` URIs.
    """

    def __init__(
        self,
        client: Client,
        *,
        task_queue: str = DEFAULT_TASK_QUEUE,
        store: ArtifactStore | None = None,
    ) -> None:
        self.temporal = client
        self.task_queue = task_queue
        self.store = store

    @classmethod
    async def connect(
        cls,
        address: str | None = None,
        namespace: str | None = None,
        *,
        task_queue: str = DEFAULT_TASK_QUEUE,
        store: ArtifactStore | None = None,
    ) -> JobClient:
        return cls(await connect_temporal(address, namespace), task_queue=task_queue, store=store)

    def handle(self, job_id: str) -> WorkflowHandle[object, JobStatus]:
        return self.temporal.get_workflow_handle(validate_job_id(job_id), result_type=JobStatus)

    async def submit(
        self, request: JobRequest, *, job_id: str | None = None, detached: bool = False
    ) -> JobStatus:
        """Start a job, or return the existing one when `job_id` was used before.

        An attached job (the default) expects to hear from a client: `watch` keeps it alive, and
        after `policy.abandon_after_s` without contact it is abandoned and its GPU work is
        stopped. A detached job runs to the end whoever is listening.
        """
        job_id = validate_job_id(job_id or f"job-{uuid.uuid4().hex[:16]}")
        if detached:
            policy = request.policy.model_copy(update={"abandon_after_s": None})
            request = request.model_copy(update={"policy": policy})
        pairs = [SearchAttributePair(STATE_KEY, JobState.QUEUED.value)]
        if tenant := request.labels.get("tenant"):
            pairs.append(SearchAttributePair(TENANT_KEY, tenant))
        try:
            await self.temporal.start_workflow(
                WORKFLOW_TYPE,
                request,
                id=job_id,
                task_queue=self.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=TypedSearchAttributes(pairs),
            )
        except WorkflowAlreadyStartedError:
            return await self.status(job_id)
        return JobStatus(job_id=job_id, state=JobState.QUEUED, detached=request.policy.detached)

    async def status(self, job_id: str) -> JobStatus:
        try:
            status: JobStatus = await self.handle(job_id).query(QUERY_STATUS, result_type=JobStatus)
            return status
        except RPCError as exc:
            if "not found" in str(exc).lower():
                raise JobNotFound(job_id) from exc
            raise

    async def client_seen(self, job_id: str) -> None:
        await self.handle(job_id).signal(SIGNAL_CLIENT_SEEN)

    async def attach(self, job_id: str) -> JobStatus:
        """Tell the job a client is (back) and get its status in one round trip."""
        status: JobStatus = await self.handle(job_id).execute_update(
            UPDATE_ATTACH, result_type=JobStatus
        )
        return status

    async def cancel(self, job_id: str, reason: str = "cancelled by a client") -> None:
        """Stop the job: its prompt is interrupted, finished artifacts are kept, CANCELLED."""
        await self.handle(job_id).signal(SIGNAL_CANCEL, CancelRequest(reason=reason))

    async def resume(self, job_id: str, *, resubmit: bool = False) -> None:
        """Continue a NEEDS_DECISION job: re-attach, or (resubmit=True) run the prompt again."""
        await self.handle(job_id).signal(SIGNAL_RESUME, ResumeRequest(resubmit=resubmit))

    async def watch(
        self,
        job_id: str,
        *,
        poll_interval_s: float = 0.5,
        keepalive_s: float | None = None,
        reconnect: ReconnectPolicy | None = None,
    ) -> AsyncIterator[JobStatus]:
        """Yield the job's status whenever it changes, the last one terminal.

        Polls the `status` query and, for attached jobs, sends `client_seen` about four times
        per abandonment horizon so the job knows someone is still listening. Transport errors
        are retried with the same bounded, jittered backoff the workflow uses; past the
        horizon without an answer `ContactLost` is raised, while the job runs on server-side.
        """
        policy = reconnect or ReconnectPolicy()
        last_seq = -1
        last_seen = float("-inf")
        failures = 0
        lost_since: float | None = None
        while True:
            try:
                if failures:
                    # Back after a gap: one update both records contact and reads the state.
                    status = await self.attach(job_id)
                    last_seen = time.monotonic()
                else:
                    status = await self.status(job_id)
            except (RPCError, RuntimeError, WorkflowUpdateFailedError) as exc:
                if isinstance(exc, RPCError) and "not found" in str(exc).lower():
                    raise JobNotFound(job_id) from exc
                lost_since = lost_since if lost_since is not None else time.monotonic()
                if time.monotonic() - lost_since > policy.horizon_s:
                    raise ContactLost(job_id, failures, exc) from exc
                delay = reconnect_delay(
                    failures, policy.base_delay_s, policy.max_delay_s, random.random()
                )
                failures += 1
                await asyncio.sleep(delay)
                continue
            failures, lost_since = 0, None
            if status.seq != last_seq or status.terminal:
                last_seq = status.seq
                yield status
            if status.terminal:
                return
            interval = keepalive_s if keepalive_s is not None else _keepalive_interval(status)
            if not status.detached and time.monotonic() - last_seen >= interval:
                await self.client_seen(job_id)
                last_seen = time.monotonic()
            await asyncio.sleep(poll_interval_s)

    async def wait(self, job_id: str) -> JobStatus:
        """Wait for the job to end; return its final status whatever the outcome."""
        try:
            await self.handle(job_id).result()
        except WorkflowFailureError:
            pass
        return await self.status(job_id)

    async def result(self, job_id: str, *, presign: bool = True) -> JobStatus:
        """The final status, with presigned URLs for the artifacts when S3 access is set up."""
        status = await self.wait(job_id)
        if presign and self.store is not None:
            status.artifacts = [await self._presigned(a) for a in status.artifacts]
        return status

    async def _presigned(self, artifact: Artifact, ttl_s: int = 3600) -> Artifact:
        assert self.store is not None
        bucket = artifact.uri.removeprefix("s3://").split("/", 1)[0]
        url = await self.store.presign_get(artifact.key, ttl_s, bucket=bucket)
        return artifact.model_copy(update={"url": url})

    async def download(self, status: JobStatus, directory: Path) -> list[Path]:
        """Download every artifact, each one checked against its sha256."""
        if self.store is None:
            raise RuntimeError("downloading needs S3 credentials in the environment")
        paths: list[Path] = []
        for artifact in status.artifacts:
            bucket = artifact.uri.removeprefix("s3://").split("/", 1)[0]
            dest = directory / artifact.key
            dest.parent.mkdir(parents=True, exist_ok=True)
            paths.append(
                await self.store.download(
                    artifact.key, dest, expected_sha256=artifact.sha256, bucket=bucket
                )
            )
        return paths


def _keepalive_interval(status: JobStatus) -> float:
    """About a quarter of the abandonment horizon, so one lost signal never abandons a job."""
    if status.abandon_after_s is None:
        return 30.0
    return max(0.1, status.abandon_after_s / 4)
