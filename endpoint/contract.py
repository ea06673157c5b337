"""What the orchestrator and the RunPod handler exchange: the job's input, its progress updates,
its output, and the claim object in S3. pydantic only, so both sides import this one file.

The input is a superset of runpod-workers/worker-comfyui's (`workflow`, `images`): a stock client
sends only those and gets a stock answer (`output.images`, base64 when no bucket is configured);
the orchestrator adds a `durable_comfy` block and gets step progress, outputs streamed to S3 as
each node finishes, and at-most-once execution per submission token.

Credentials never travel in a job: the handler reads its bucket's from its own environment
(`BUCKET_ENDPOINT_URL`, `BUCKET_ACCESS_KEY_ID`, `BUCKET_SECRET_ACCESS_KEY`, as worker-comfyui).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from activities.keys import job_folder, safe_component

# The claim of one submission token lives beside the job's artifacts; the orchestrator reads it.
CLAIMS_FOLDER = "_claims"
# Input files the orchestrator staged for the handler to fetch (see StagedInput).
INPUTS_FOLDER = "_inputs"
# ComfyUI's own --max-upload-size default: no input file can be bigger on the worker anyway.
MAX_INPUT_FILE_BYTES = 100 * 1024 * 1024
# How long a claim holds without renewal; the holder renews it every third of this.
DEFAULT_LEASE_S = 60.0
# The runpod SDK refuses bigger progress updates and job-done bodies are best kept small.
MAX_UPDATE_BYTES = 512 * 1024


class _Contract(BaseModel):
    # Tolerant on read: a newer orchestrator or handler may add fields.
    model_config = ConfigDict(extra="ignore")


class InputImage(_Contract):
    """worker-comfyui's input file: `image` is base64 or a data URI; `name` what LoadImage names."""

    name: str = Field(min_length=1, max_length=255)
    image: str


class StagedInput(_Contract):
    """An input file the orchestrator put in the job's bucket folder (`{prefix}/{job_id}/_inputs/`)
    instead of the `/run` body, which RunPod caps at 10 MB. The handler fetches it with its own
    bucket credentials, checks `size` and `sha256`, and uploads it to its ComfyUI as `name`."""

    name: str = Field(min_length=1, max_length=255)
    key: str = Field(min_length=1, max_length=1024)
    size: int = Field(ge=0, le=MAX_INPUT_FILE_BYTES)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class S3Target(_Contract):
    """Where outputs go: `{prefix}/{job_id}/{segment}/{node_id}/{filename}` in `bucket`."""

    bucket: str
    prefix: str = "jobs"


class Orchestration(_Contract):
    """The orchestrator's block (`input.durable_comfy`). Absent for stock clients."""

    job_id: str
    # One per submission of one segment: the claim's key. A re-delivery or a resubmission after a
    # lost `/run` answer carries the same token, and runs the graph at most once.
    submission: str = Field(min_length=8, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$")
    segment: int = Field(0, ge=0)
    # The ComfyUI prompt id and socket client id to use (ours, so a handler restart can find it).
    prompt_id: str
    client_id: str
    run_tag: str = ""
    output: S3Target
    sampler_steps: dict[str, int] = Field(default_factory=dict)
    nodes_total: int = 0
    progress_interval_s: float = Field(2.0, ge=0.0)
    claims: bool = True
    lease_s: float = Field(DEFAULT_LEASE_S, ge=5.0)
    # Input files by reference (in `output.bucket`), beside any inline `images`.
    inputs: list[StagedInput] = Field(default_factory=list)


class EndpointInput(_Contract):
    """`job["input"]` as the handler reads it."""

    workflow: dict[str, Any]
    images: list[InputImage] = Field(default_factory=list)
    durable_comfy: Orchestration | None = None
    # worker-comfyui's per-request key for Comfy.org API nodes (else COMFY_ORG_API_KEY).
    api_key_comfy_org: str | None = None

    @field_validator("workflow", mode="before")
    @classmethod
    def _json_string(cls, value: Any) -> Any:
        # worker-comfyui accepts the graph as an object or as a JSON string.
        if isinstance(value, str):
            return json.loads(value)
        return value


class ArtifactRecord(_Contract):
    """One output, as worker-comfyui reports it plus what makes it verifiable.

    `type` "s3_url": `data` is `s3://bucket/key` (`bucket`/`key` say the same, unsigned; the
    orchestrator verifies size and sha256 in S3 before it counts). "base64": `data` is the file.
    """

    filename: str
    subfolder: str = ""
    type: Literal["s3_url", "base64"]
    data: str
    node_id: str = ""
    size: int | None = None
    sha256: str | None = None
    content_type: str = "application/octet-stream"
    bucket: str | None = None
    key: str | None = None


# "starting": waiting for the worker's ComfyUI to answer (a cold start).
ProgressStage = Literal["claiming", "starting", "queued", "running", "uploading"]


class ProgressUpdate(_Contract):
    """What `runpod.serverless.progress_update` sends; `/status` shows it while IN_PROGRESS."""

    kind: Literal["durable_comfy.progress"] = "durable_comfy.progress"
    submission: str
    prompt_id: str
    stage: ProgressStage = "running"
    # Increases with every update of one delivery: the SDK posts each update from its own
    # thread, so they can arrive out of order; keep the highest.
    seq: int = 0
    worker_id: str = ""
    queue_position: int | None = None
    step: int = 0
    total_steps: int = 0
    node: str | None = None
    nodes_done: list[str] = Field(default_factory=list)
    node_steps: dict[str, int] = Field(default_factory=dict)
    artifacts: list[ArtifactRecord] = Field(default_factory=list)
    # The oldest records left out to keep the update under MAX_UPDATE_BYTES (the output and
    # the claim carry them all).
    artifacts_omitted: int = 0
    at: datetime


class EndpointOutput(_Contract):
    """The handler's return value (RunPod's `output`)."""

    images: list[ArtifactRecord] = Field(default_factory=list)
    # Non-fatal problems (an output that could not be stored is fatal, not listed here).
    errors: list[str] = Field(default_factory=list)
    status: Literal["success", "success_no_images", "claimed_elsewhere"] = "success"
    # With a durable_comfy block: who ran it. On "claimed_elsewhere", the RunPod job that holds it.
    submission: str | None = None
    claim_holder: str | None = None
    prompt_id: str | None = None
    # True when this delivery ran nothing and returns the outcome the claim recorded.
    replayed: bool = False


class EndpointError(_Contract):
    """The handler's return value on failure. The SDK moves `error` (and `refresh_worker`, as
    `stopPod`) out of it; the rest stays in RunPod's `output`."""

    error: str
    # workflows.shared.ErrorType's names (InvalidRequest, MissingInput, PromptRejected,
    # ExecutionError, OutOfMemory, BackendFault, BackendUnavailable, BackendError, Interrupted,
    # PromptLost, OutputMissing, StorageError, Cancelled), plus OutputTooLarge for base64
    # results.
    error_type: str
    details: list[str] = Field(default_factory=list)
    # The platform replaces the worker after this job (a CUDA fault, ComfyUI gone).
    refresh_worker: bool = False
    submission: str | None = None
    prompt_id: str | None = None
    claim_holder: str | None = None
    replayed: bool = False
    # Outputs stored before the failure (kept, as the ComfyUI backend keeps them).
    images: list[ArtifactRecord] = Field(default_factory=list)


class ClaimOutcome(_Contract):
    state: Literal["completed", "failed", "cancelled"]
    error: str | None = None
    error_type: str | None = None
    images: list[ArtifactRecord] = Field(default_factory=list)
    at: datetime


class Claim(_Contract):
    """`{prefix}/{job_id}/_claims/{submission}.json`: who runs a submission, until when.

    Created with `If-None-Match: *` (one creator wins); renewed and taken over with
    `If-Match: <etag>`; finished with the outcome, after which it never changes.
    """

    submission: str
    job_id: str
    segment: int = 0
    prompt_id: str
    holder: str  # the RunPod job id running it
    worker_id: str = ""
    lease_until: datetime
    renewed_at: datetime
    takeovers: int = 0
    outcome: ClaimOutcome | None = None


def inputs_folder(target: S3Target, job_id: str) -> str:
    """Where a job's staged input files are, and the only place a handler fetches them from."""
    return f"{job_folder(target.prefix, job_id)}/{INPUTS_FOLDER}"


def claim_key(target: S3Target, job_id: str, submission: str) -> str:
    """The claim's object key, in the job's own folder beside its artifacts (the same sanitised
    folder `activities.keys.artifact_key` uses)."""
    return f"{job_folder(target.prefix, job_id)}/{CLAIMS_FOLDER}/{safe_component(submission)}.json"
