"""Errors of the client library.

    ClientError
    ├── InvalidJobId         a job ID outside JOB_ID_PATTERN (nothing was sent)
    ├── InputFileError       a graph or `--input NAME=PATH` file that cannot be read or named
    ├── InvalidOverride      a segment override naming a node or input the graph does not have
    ├── InputNeedsStaging    an input too large to send inline, and no bucket to stage it
    ├── RequestTooLarge      the request is over Temporal's payload limit (pass inputs by S3)
    ├── SettingsError        a client setting's variable holds a bad value (named)
    ├── StorageNotConfigured the bucket is needed but not configured, or its settings are bad
    ├── StorageFailed        the bucket failed a presign, a staging upload or a download, or a
    │                        downloaded file does not match its recorded sha256
    ├── UnsafeArtifactKey    an artifact whose key would leave the download directory
    ├── JobNotFound          no job with that ID in this namespace
    ├── JobConflict          the ID is taken by a different request
    ├── InvalidBatch         a batch that cannot start as sent (two tenants, over 1,000 jobs,
    │                        an override that fits no node); nothing was started
    ├── BatchNotFound        no batch with that ID in this namespace
    ├── BatchConflict        the batch ID is taken by a different batch
    ├── BudgetExceeded       the tenant's daily budget is spent and its settings refuse new jobs
    │                        until the reset (`.resets_at`); nothing was started
    ├── DrainRefused         the pool's queue turned a drain or undrain down (`.reason`)
    │   └── UnknownServer    a server the pool's queue does not have (`.servers`: the ones it has)
    ├── JobAlreadyEnded      the action needs a job that still runs; `.status` is its final one
    ├── ResumeRefused        the job turned the resume down; `.reason` says why
    ├── TemporalUnreachable  no connection to the Temporal server, or no answer in time
    ├── TemporalRefused      Temporal answered the call with an error (`.status` names it)
    ├── NamespaceMissing     the configured namespace does not exist on the server
    ├── SearchAttributesMissing  the namespace lacks search attributes a job is started with
    │                        (the message holds the commands that register them)
    ├── JobUnanswered        the job exists but no worker answered for it
    └── ContactLost          Temporal unreachable past the reconnect horizon (the job runs on)

`JobClient` raises nothing else of its own: the SDK's `RPCError`s and the bucket's
`StorageError`s become the errors above. Validation problems with a request are pydantic
`ValidationError`s raised when the `JobRequest` is built, before anything is sent: they say which
field is wrong and how to fix it.

Not client errors (the library's users never see them):

    ChecksFailed             the worker's start-up checks refused the start (starter.doctor)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from workflows.contracts import MAX_INLINE_INPUT_BYTES, MAX_INLINE_TOTAL_BYTES

if TYPE_CHECKING:
    from workflows.contracts import JobStatus


class ClientError(Exception):
    """Base of the client library's own errors."""


class InvalidJobId(ClientError, ValueError):
    """Also a ValueError: that is what `validate_job_id` raised before this class existed."""


class InputFileError(ClientError):
    """An input file named on the command line cannot be used."""


class InvalidOverride(ClientError):
    """A segment override names a node or an input that is not in the graph.

    ComfyUI would ignore an unknown input silently, so a typo (`sede` for `seed`) would run
    every segment with the same values; refused before anything is submitted.
    """


class InputNeedsStaging(ClientError):
    """An input is too large to send inline, and the client has no S3 access to stage it."""

    def __init__(self, name: str, size: int) -> None:
        why = (
            f"inputs over {MAX_INLINE_INPUT_BYTES:,} bytes do"
            if size > MAX_INLINE_INPUT_BYTES
            else f"inline inputs together over {MAX_INLINE_TOTAL_BYTES:,} bytes do"
        )
        super().__init__(
            f"input {name!r} is {size:,} bytes: {why} "
            "not fit in a job's request and are staged to S3 by the client, which needs the "
            "bucket: set DURABLE_COMFY_BUCKET (and DURABLE_COMFY_S3_ENDPOINT off AWS) with "
            "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile); or upload it "
            f"yourself and pass --input {name}=s3://BUCKET/KEY (JobClient.connect() opens the "
            "bucket from the same variables)"
        )
        self.name = name
        self.size = size


class RequestTooLarge(ClientError):
    """Temporal stores a job's request in its history, and caps each payload (2 MiB default)."""

    def __init__(self, size: int, limit: int | None) -> None:
        over = f"over Temporal's limit of {limit:,} bytes" if limit else "over the server's limit"
        super().__init__(
            f"the request is {size:,} bytes, {over} for a job's input; inline inputs count in "
            "full (as base64): upload big inputs to S3 and pass them by reference, "
            "--input NAME=s3://BUCKET/KEY (JobRequest.inputs: S3Input(uri='s3://BUCKET/KEY'))"
        )
        self.size = size
        self.limit = limit


class SettingsError(ClientError):
    """A variable the client reads (DURABLE_COMFY_TASK_QUEUE, ...) holds a value it cannot use."""


class StorageNotConfigured(ClientError):
    """Downloading needs S3 access; URIs and sha256s are available without it. Also raised
    when the bucket's settings are there but unusable, or S3 rejects the credentials."""


class StorageFailed(ClientError):
    """The bucket failed an operation the client asked of it; `.retryable` says whether trying
    again may help (a bad sha256 will not)."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class UnsafeArtifactKey(ClientError):
    """An artifact whose key would be written outside the download directory."""


class QueueFull(ClientError):
    """Refused for capacity: the pool's queue holds as many of the tenant's jobs (its
    `max_pending`), or of all tenants' (the pool's), as it may. Nothing was started; try again
    after `retry_after_s` (None: the pool has no recent hold times to tell)."""

    def __init__(self, pool: str, tenant: str, reason: str, retry_after_s: float | None) -> None:
        self.pool, self.tenant, self.reason = pool, tenant, reason
        self.retry_after_s = retry_after_s
        # Whole seconds rounded up, as the gateway's Retry-After says it.
        when = "later" if retry_after_s is None else f"in about {math.ceil(retry_after_s)} s"
        super().__init__(f"queue full: {reason}; nothing was started, try again {when}")


class BudgetExceeded(ClientError):
    """Refused for capacity: the tenant's spend today has reached its daily budget, and its
    settings say `over_budget: refuse` (with `wait`, the job would wait PENDING instead).
    Nothing was started; try again after `resets_at` (`retry_after_s` from now)."""

    def __init__(
        self,
        tenant: str,
        reason: str,
        resets_at: datetime,
        *,
        spent_gpu_s: float = 0.0,
        gpu_seconds_per_day: float | None = None,
        spent_usd: float = 0.0,
        usd_per_day: float | None = None,
    ) -> None:
        self.tenant, self.reason, self.resets_at = tenant, reason, resets_at
        self.spent_gpu_s, self.gpu_seconds_per_day = spent_gpu_s, gpu_seconds_per_day
        self.spent_usd, self.usd_per_day = spent_usd, usd_per_day
        left = (resets_at - datetime.now(UTC)).total_seconds()
        self.retry_after_s = max(math.ceil(left), 1)
        at = resets_at.astimezone(UTC)
        when = at.strftime("%H:%M UTC" if at.second == 0 else "%H:%M:%S UTC")
        super().__init__(
            f"budget exceeded: {reason}; nothing was started, its budget resets at {when} "
            f"(in about {self.retry_after_s} s)"
        )


class NoPoolQueue(ClientError, LookupError):
    """No queue runs for the pool: it is unbounded (no `max_running`), or no job has asked for
    one of its slots yet."""


class DrainRefused(ClientError):
    """The pool's queue turned a `drain_pool` / `undrain_pool` down (a dispatcher of a version
    without the update, ...); nothing changed."""

    def __init__(self, pool: str, reason: str, *, drain: bool = True) -> None:
        action = "drain" if drain else "undrain"
        super().__init__(f"pool {pool!r}'s queue refused the {action}: {reason}")
        self.pool = pool
        self.reason = reason


class UnknownServer(DrainRefused, LookupError):
    """A drain named a server its pool's queue does not have; `.servers` are those it has (none:
    the queue picks no servers, a pool of one backend). Nothing changed."""

    def __init__(
        self, pool: str, server: str, servers: Sequence[str], *, drain: bool = True
    ) -> None:
        if servers:
            reason = f"{server} is not one of its servers ({', '.join(servers)})"
        else:
            reason = (
                f"it picks no servers, so it has no {server} (a pool of one backend, or none "
                "of its jobs has asked since the pool was given `urls`): drain the whole pool"
            )
        super().__init__(pool, reason, drain=drain)
        self.server = server
        self.servers = list(servers)


class JobNotFound(ClientError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r} in this namespace")
        self.job_id = job_id


class JobConflict(ClientError):
    """The job ID is in use by a job that was submitted with a different request."""

    def __init__(self, job_id: str, existing_sha256: str, requested_sha256: str) -> None:
        super().__init__(
            f"job ID {job_id!r} is already used by a different request (sha256 "
            f"{existing_sha256[:12]}…, yours {requested_sha256[:12]}…); nothing was submitted: "
            f"pick another ID, or look at the existing job with `durable-comfy status {job_id}`"
        )
        self.job_id = job_id
        self.existing_sha256 = existing_sha256
        self.requested_sha256 = requested_sha256


class InvalidBatch(ClientError):
    """A batch that cannot start as sent; nothing of it was started."""


class BatchNotFound(ClientError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"no batch {batch_id!r} in this namespace")
        self.batch_id = batch_id


class BatchConflict(ClientError):
    """The batch ID is in use by a batch with other jobs."""

    def __init__(self, batch_id: str) -> None:
        super().__init__(
            f"batch ID {batch_id!r} is already used by a batch of other jobs; nothing was "
            "submitted: pick another ID, or look at it with "
            f"`durable-comfy batch status {batch_id}`"
        )
        self.batch_id = batch_id


class JobAlreadyEnded(ClientError):
    """The job has ended, so there is nothing left to cancel or resume."""

    def __init__(self, job_id: str, status: JobStatus, action: str) -> None:
        why = f" ({status.error.type}: {status.error.message})" if status.error else ""
        super().__init__(f"job {job_id!r} already ended {status.state.value}{why}; {action}")
        self.job_id = job_id
        self.status = status


class ResumeRefused(ClientError):
    """The job declined the resume (not NEEDS_DECISION, or a re-attach it cannot do)."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"job {job_id!r} refused to resume: {reason}")
        self.job_id = job_id
        self.reason = reason


class TemporalUnreachable(ClientError):
    """Nothing answered at `target`, or it refused the connection; `tls`: the connection was
    configured with TLS (a refusal is then most often a certificate the front does not take)."""

    def __init__(
        self, target: str, detail: str, *, tls: bool = False, by_default: bool = False
    ) -> None:
        why = (
            " (Temporal's default address: no TEMPORAL_ADDRESS is set and no temporal.toml "
            "profile names one; load your stack's env file, `. .devstack/env`, or "
            "`<state_dir>/env` for a stack started with CONFIG=...)"
            if by_default
            else ""
        )
        super().__init__(f"cannot reach Temporal at {target}: {detail}{why}")
        self.target = target
        self.tls = tls
        self.by_default = by_default


class TemporalRefused(ClientError):
    """Temporal answered the call with an error that none of the other classes describe
    (permission denied, a namespace that does not exist, ...)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"Temporal refused: {status}: {message}")
        self.status = status
        self.detail = message


class NamespaceMissing(ClientError):
    """The Temporal server has no namespace of the configured name (a typo, another
    deployment's name, a dev server started without it): a setting to fix, as `doctor` says."""

    def __init__(self, namespace: str, target: str) -> None:
        super().__init__(
            f"namespace {namespace!r} does not exist on {target}: set TEMPORAL_NAMESPACE to "
            f"yours, or create it (`temporal operator namespace create --namespace {namespace}`)"
        )
        self.namespace = namespace
        self.target = target


def is_namespace_missing(status: str, message: str) -> bool:
    """Temporal's NOT_FOUND for the namespace itself, not for a workflow in it."""
    return status == "NOT_FOUND" and message.lower().startswith("namespace ")


class SearchAttributesMissing(ClientError):
    """The namespace has no mapping for a search attribute a job is started with.

    Not a `TemporalRefused`: nothing is down, the namespace needs a one-time registration
    (`durable-comfy doctor` checks it). `.missing` names what Temporal (or the doctor) found
    missing; `.commands` register every attribute in `register` (name: type) on a self-hosted
    cluster and on Temporal Cloud (one that exists already is left as it is).
    """

    def __init__(self, namespace: str, missing: Sequence[str], register: Mapping[str, str]) -> None:
        self.namespace = namespace
        self.missing = list(missing)
        self.commands = register_commands(namespace, register)
        super().__init__(
            f"namespace {namespace!r} has no search attribute {', '.join(self.missing)}; "
            f"register them once: {self.commands[0]} (self-hosted), or {self.commands[1]} "
            "(Temporal Cloud, or its UI: the namespace's Search Attributes)"
        )


def register_commands(namespace: str, names: Mapping[str, str]) -> tuple[str, str]:
    """The `temporal` (self-hosted) and `tcld` (Temporal Cloud) commands that register `names`
    (attribute: type) on `namespace`, all of them in one command each."""
    pairs: Sequence[tuple[str, str]] = list(names.items())
    self_hosted = " ".join(
        ["temporal operator search-attribute create", f"--namespace {namespace}"]
        + [f"--name {name} --type {kind}" for name, kind in pairs]
    )
    cloud = " ".join(
        ["tcld namespace search-attributes add", f"--namespace {namespace}"]
        + [f"--search-attribute {name}={kind}" for name, kind in pairs]
    )
    return f"`{self_hosted}`", f"`{cloud}`"


class JobUnanswered(ClientError):
    """The job exists and runs, but no worker answered for it in time.

    Queries are answered by a worker replaying the job; with none polling its task queue (or
    one that is stuck) there is no status to give. The job is unaffected.
    """

    def __init__(self, job_id: str, task_queue: str, detail: str) -> None:
        super().__init__(
            f"job {job_id!r} exists but no worker answered for it ({detail}): is a worker "
            f"running on task queue {task_queue!r}? (`durable-comfy worker`)"
        )
        self.job_id = job_id
        self.task_queue = task_queue


class ContactLost(ClientError):
    """The client could not reach Temporal for longer than the reconnect horizon.

    The job itself is unaffected: its state lives server-side. Watch it again by ID later; an
    attached job that hears from nobody for `abandon_after_s` is abandoned and torn down.
    """

    def __init__(self, job_id: str, attempts: int, last_error: BaseException) -> None:
        super().__init__(
            f"lost contact with job {job_id!r} after {attempts} attempt(s): {last_error}; "
            "the job keeps running server-side"
        )
        self.job_id = job_id
        self.attempts = attempts


class ChecksFailed(Exception):
    """The worker's start-up checks found a problem: `.lines` are the doctor's lines of every
    check not passed, `.exit_code` the exit the refused start ends with."""

    def __init__(self, lines: Sequence[str], exit_code: int) -> None:
        super().__init__("; ".join(lines))
        self.lines = list(lines)
        self.exit_code = exit_code
