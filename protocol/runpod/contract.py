"""What the orchestrator and the RunPod handler exchange: the job's input, its progress updates,
its output, and the claim object in S3. pydantic and `protocol.keys` only, so both sides
import this one file: the orchestrator (`activities/runpod/`) and the handler (`endpoint/`, in its
own venv, which has no Temporal).

The input is a superset of runpod-workers/worker-comfyui's (`workflow`, `images`): a stock client
sends only those and gets a stock answer (`output.images`, base64 when no bucket is configured);
the orchestrator adds a `durable_comfy` block and gets step progress, outputs streamed to S3 as
each node finishes, and at-most-once execution per submission token.

Credentials never travel in a job: the handler reads its bucket's from its own environment
(`BUCKET_ENDPOINT_URL`, `BUCKET_ACCESS_KEY_ID`, `BUCKET_SECRET_ACCESS_KEY`, as worker-comfyui).
"""

from __future__ import annotations

import email.utils
import json
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocol.keys import job_folder, safe_component

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
# How long a handler keeps making sure a stopped job's prompt has left its ComfyUI, unless the
# job says (`Orchestration.stop_horizon_s`): the orchestrator's teardown horizon, less a margin.
DEFAULT_STOP_HORIZON_S = 120.0
# Where handlers publish their ComfyUI's node registry, in the orchestrator's default bucket.
ENDPOINTS_FOLDER = "_durable_comfy/endpoints"
# How long after a claim's lease ran out its holder is certainly fenced (its prompt stopped, or
# its worker gone), unless the job says (`Orchestration.fence_after_s`, the pool's setting): a
# holder that cannot renew stops its prompt before its lease ends, and the worker's watchdog
# (endpoint/watchdog.py) stops it and takes the worker down by then when the handler itself
# is frozen. Only past this does anyone run the submission again.
DEFAULT_FENCE_AFTER_S = 30.0
# A claim keeps this many holders before its last takeover (`Claim.earlier`, newest kept): a
# bound on the claim's size that only a submission lost again and again would reach.
MAX_EARLIER_HOLDERS = 16


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


class NodesTarget(_Contract):
    """`s3://{bucket}/{key}`: where a handler publishes its ComfyUI's `/object_info`
    (`nodes_key`), as a `PublishedNodes` document."""

    bucket: str
    key: str = Field(min_length=1, max_length=1024)


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
    # How long, after the platform stops the job, the handler keeps stopping the prompt
    # (dequeue, prompt-scoped interrupt, re-check) before it gives up on it and replaces its
    # worker. The orchestrator sends its teardown horizon less a margin, so it reads the
    # handler's verdict (`ClaimOutcome.stop`) before its own horizon ends.
    stop_horizon_s: float = Field(DEFAULT_STOP_HORIZON_S, ge=1.0)
    # Where to publish this worker's ComfyUI node registry (`/object_info`), once per handler
    # process, so the orchestrator checks graphs before a job reaches a paid worker.
    nodes: NodesTarget | None = None
    # How long past a lapsed lease its holder is certainly fenced (DEFAULT_FENCE_AFTER_S): a
    # delivery takes a lapsed claim over only past it, or once the claim records the fence.
    fence_after_s: float = Field(DEFAULT_FENCE_AFTER_S, ge=1.0)


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
    # True when the submission's claim holds this failure as its outcome (finished "failed", or
    # a replayed outcome): the submission never runs again. False when no claim records it:
    # claims were off, or the claim could not be written (storage down past the handler's retry
    # budget, BUCKET_RETRY_S), so it has no outcome and its lease lapses; a later delivery of
    # the same submission may then take it over and run it.
    claim_recorded: bool = False


# What became of a stopped job's prompt, as the handler saw it on its own ComfyUI:
#   never_submitted  the job was stopped before the prompt reached ComfyUI
#   dequeued         taken out of ComfyUI's queue before it started
#   interrupted      ended by the handler's prompt-scoped interrupt
#   finished         it had ended on its own (success) before the stop landed
#   failed           it had ended with an error of its own
#   gone             no longer queued or running, and ComfyUI has no record of how it ended
#   still_running    still running at the stop horizon: the handler replaced its worker
PromptFate = Literal[
    "never_submitted", "dequeued", "interrupted", "finished", "failed", "gone", "still_running"
]


class StopRecord(_Contract):
    """How the handler stopped a job's prompt, written into the claim's outcome once the
    prompt is gone (or once the handler gave up on it): the orchestrator's teardown reads
    this, never a lease that ran out."""

    prompt: PromptFate
    started_at: datetime
    at: datetime
    # Queue / history checks made, and stop requests sent (dequeue or interrupt).
    checks: int = 0
    requests: int = 0
    node: str | None = None
    node_type: str | None = None
    detail: str = ""
    worker_id: str = ""
    # The prompt outlived the stop horizon: the handler killed its worker's ComfyUI and ended
    # the worker process, so no later job queues behind the prompt or pays for it.
    worker_replaced: bool = False


class ClaimOutcome(_Contract):
    state: Literal["completed", "failed", "cancelled"]
    error: str | None = None
    error_type: str | None = None
    images: list[ArtifactRecord] = Field(default_factory=list)
    at: datetime
    # Set when the platform stopped the job (state "cancelled"): what became of the prompt.
    stop: StopRecord | None = None


class OutputFile(_Contract):
    """One file the prompt's `/history` lists as a node's output (type `output`)."""

    node_id: str
    filename: str
    subfolder: str = ""


class PromptEnd(_Contract):
    """How the held prompt ended on ComfyUI, recorded in the claim before any upload: with
    `success`, the outputs ComfyUI listed. A later delivery (or the orchestrator, after a lost
    holder) then knows the GPU work is done and what must be in the bucket for the job to be."""

    outcome: Literal["success", "error", "interrupted"]
    at: datetime
    outputs: list[OutputFile] = Field(default_factory=list)


# What a holder that could not renew its claim did to its prompt before its lease ran out:
#   dequeued / interrupted   as in PromptFate
#   ended                    it had ended already (its `prompt_end` says how)
#   never_submitted          no prompt was sent
#   still_running            it would not stop: the worker's ComfyUI was killed
FenceAction = Literal["dequeued", "interrupted", "ended", "never_submitted", "still_running"]


class FenceRecord(_Contract):
    """A holder fenced itself: it could not renew its lease, so it stopped its prompt before
    the lease ran out (`at`), and wrote this once it could write again. A claim with a fence
    may be taken over at once."""

    action: FenceAction
    at: datetime
    worker_id: str = ""
    detail: str = ""


class EarlierHolder(_Contract):
    """A delivery that held the claim before a takeover, as the claim said when it was taken:
    a redelivered RunPod job (the same job on another worker) is billed for it, but RunPod's
    figures for the job count only its last delivery."""

    holder: str
    worker_id: str = ""
    # None: written by a handler before claims said when they were taken.
    claimed_at: datetime | None = None
    renewed_at: datetime
    lease_until: datetime


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
    # When this holder took the claim (created it or took it over); kept by its renewals.
    claimed_at: datetime | None = None
    takeovers: int = 0
    # The holders before a takeover, oldest first (`MAX_EARLIER_HOLDERS` at most).
    earlier: list[EarlierHolder] = Field(default_factory=list)
    # When the platform stopped the job and the handler began stopping its prompt (the lease is
    # renewed meanwhile; the outcome, with its `stop` record, follows once the prompt is gone).
    stopping_since: datetime | None = None
    # The prompt ended (written at once, before any upload), and each output as it is stored
    # (written with the next renewal, or at once): after a lost holder, what is left to do.
    prompt_end: PromptEnd | None = None
    stored: list[ArtifactRecord] = Field(default_factory=list)
    # The holder could not renew and stopped its prompt before its lease ran out.
    fenced: FenceRecord | None = None
    outcome: ClaimOutcome | None = None


class PublishedNodes(_Contract):
    """A handler's ComfyUI node registry as published to `Orchestration.nodes`."""

    endpoint_id: str = ""
    worker_id: str = ""
    published_at: datetime
    # ComfyUI's `GET /object_info`, whole: {class_type: {input: {required, optional}, ...}}.
    object_info: dict[str, Any]


def server_age_s(last_modified: datetime | None, date_header: str | None) -> float:
    """How old an object is by the S3 server's clock: its `Date` header less its
    `Last-Modified` (the local clock stands in for a missing `Date`). A claim's lease is judged
    by this on both sides, so a holder's and a reader's clocks need not agree."""
    if last_modified is None:
        return 0.0
    now = datetime.now(UTC)
    if date_header:
        try:
            now = email.utils.parsedate_to_datetime(date_header)
        except (TypeError, ValueError):
            pass
    return max(0.0, (now - last_modified).total_seconds())


def nodes_key(endpoint_id: str) -> str:
    """The key a handler of endpoint `endpoint_id` publishes its node registry under."""
    return f"{ENDPOINTS_FOLDER}/{safe_component(endpoint_id)}/object_info.json"


def inputs_folder(target: S3Target, job_id: str) -> str:
    """Where a job's staged input files are, and the only place a handler fetches them from."""
    return f"{job_folder(target.prefix, job_id)}/{INPUTS_FOLDER}"


def claim_key(target: S3Target, job_id: str, submission: str) -> str:
    """The claim's object key, in the job's own folder beside its artifacts (the same sanitised
    folder `protocol.keys.artifact_key` uses)."""
    return f"{job_folder(target.prefix, job_id)}/{CLAIMS_FOLDER}/{safe_component(submission)}.json"


def deliveries_folder(target: S3Target, job_id: str, submission: str) -> str:
    """Where each delivery of a submission leaves a marker named after its RunPod job as it
    claims: a `/run` whose answer was lost makes a RunPod job whose id only
    this folder tells the orchestrator, which reads what it billed for the job's cost."""
    return (
        f"{job_folder(target.prefix, job_id)}/{CLAIMS_FOLDER}/"
        f"{safe_component(submission)}.deliveries"
    )


def delivery_key(target: S3Target, job_id: str, submission: str, runpod_job_id: str) -> str:
    return f"{deliveries_folder(target, job_id, submission)}/{safe_component(runpod_job_id)}"
