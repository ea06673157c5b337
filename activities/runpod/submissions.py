"""The registry of live RunPod submissions, written by the orchestrator: what the orphan sweep
reads to find a RunPod job whose workflow is over.

`temporal workflow terminate` (or a run timeout) ends a job without its teardown; its RunPod job
would run, and bill, until its execution timeout. ComfyUI prompts carry a tag the sweep finds in
`/queue`; RunPod has no such listing, so each follow records its submission in the
orchestrator's default bucket, one small JSON object per submission:

    _durable_comfy/runpod-submissions/{pool}/{job_id}/{submission}.json

written just before `/run` is sent (so an attempt that dies waiting for the answer leaves word),
written again with RunPod's job id once `/run` answered, and deleted once the submission is
known to have ended (the follow saw its RunPod job end, or a stop check did). Three requests a
submission. With claims, a record whose `/run` answer was lost is resolved through the claim
(in the job's own output bucket and prefix, recorded here for that); for a stock endpoint the
record is the only trace.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import structlog
from pydantic import BaseModel, ConfigDict, ValidationError
from temporalio import activity

from activities.errors import retryable
from activities.runpod.models import RunPolicy
from activities.storage import ArtifactStore
from configuration.pools import PoolConfig
from protocol.keys import safe_component
from protocol.runpod.contract import S3Target
from workflows.activity_io import FollowInput
from workflows.errors import IntegrityError, ObjectMissing, StorageError
from workflows.shared import ErrorType

log = structlog.get_logger(__name__)

REGISTRY_FOLDER = "_durable_comfy/runpod-submissions"
# A record is a few hundred bytes: anything bigger is not one of ours.
MAX_RECORD_BYTES = 64 * 1024
# Past its ttl RunPod has deleted the job; this much later a record nobody could resolve (its
# `/run` answer lost, no claim) is dropped.
EXPIRY_MARGIN = timedelta(minutes=10)


class SubmissionRecord(BaseModel):
    """One submission sent (or about to be sent) to a RunPod endpoint."""

    model_config = ConfigDict(extra="ignore")

    namespace: str
    pool: str
    endpoint_id: str
    job_id: str  # the workflow id
    segment: int = 0
    submission: str
    # RunPod's job id, once `/run` answered.
    runpod_job_id: str | None = None
    claims: bool = False
    # The job's output bucket and prefix: where its claim is.
    output: S3Target
    at: datetime
    # No RunPod job of this submission can exist after this (its ttl, and a margin).
    expires_at: datetime


def pool_folder(pool: str) -> str:
    return f"{REGISTRY_FOLDER}/{safe_component(pool)}/"


def record_key(pool: str, job_id: str, submission: str) -> str:
    return f"{pool_folder(pool)}{safe_component(job_id)}/{safe_component(submission)}.json"


async def submitting(
    store: ArtifactStore,
    req: FollowInput,
    pool: PoolConfig,
    output: S3Target,
    policy: RunPolicy,
) -> SubmissionRecord:
    """Record a submission about to be sent. Raises a retryable failure when the record
    cannot be written: a job the sweep could never find is not sent."""
    now = datetime.now(UTC)
    record = SubmissionRecord(
        namespace=activity.info().namespace if activity.in_activity() else "",
        pool=req.named_pool,
        endpoint_id=pool.endpoint_id or "",
        job_id=req.job_id,
        segment=req.segment,
        submission=req.prompt_id,
        claims=bool(pool.claims),
        output=output,
        at=now,
        expires_at=now + timedelta(milliseconds=policy.ttl_ms) + EXPIRY_MARGIN,
    )
    try:
        await _put(store, record)
    except StorageError as exc:
        raise retryable(
            ErrorType.STORAGE_ERROR,
            f"recording submission {req.prompt_id} before sending it to RunPod: {exc}",
        ) from exc
    return record


async def submitted(store: ArtifactStore, record: SubmissionRecord, runpod_job_id: str) -> None:
    """Add RunPod's job id to the record. Best effort: the job is running by now, and a record
    without the id still names the submission (with claims the claim names the job)."""
    try:
        await _put(store, record.model_copy(update={"runpod_job_id": runpod_job_id}))
    except StorageError as exc:
        log.warning(
            "runpod_submission_id_unrecorded",
            job_id=record.job_id,
            submission=record.submission,
            runpod_job_id=runpod_job_id,
            error=str(exc),
        )


async def ended(store: ArtifactStore, pool: str, job_id: str, submission: str) -> None:
    """The submission's RunPod job has ended (or RunPod no longer knows it): forget it. Best
    effort: a record left behind is removed by the sweep once the workflow is over."""
    try:
        await store.delete(record_key(pool, job_id, submission))
    except StorageError as exc:
        log.warning(
            "runpod_submission_record_kept", job_id=job_id, submission=submission, error=str(exc)
        )


async def listed(store: ArtifactStore, pool: str) -> list[tuple[str, str]]:
    """Every record key of `pool`, with the workflow id its key names (as sanitised for the
    key: the record itself has the id as it is)."""
    folder = pool_folder(pool)
    found = []
    for key in await store.list_keys(folder):
        job, _, _name = key.removeprefix(folder).partition("/")
        found.append((key, job))
    return found


async def read_record(store: ArtifactStore, key: str) -> SubmissionRecord | None:
    """The record at `key`; None when it has gone meanwhile; a `ValueError` when it is not one
    of ours."""
    try:
        data = await store.read_bytes(key, limit=MAX_RECORD_BYTES)
    except ObjectMissing:
        return None
    except IntegrityError as exc:  # too big to be one
        raise ValueError(str(exc)) from None
    try:
        return SubmissionRecord.model_validate_json(data)
    except ValidationError as exc:
        raise ValueError(f"not a submission record: {exc.error_count()} problem(s)") from None


async def _put(store: ArtifactStore, record: SubmissionRecord) -> None:
    await store.put_small(
        record_key(record.pool, record.job_id, record.submission),
        record.model_dump_json().encode(),
        content_type="application/json",
    )
