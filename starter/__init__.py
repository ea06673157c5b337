"""Client side of durable-comfy: the `JobClient` library and the `durable-comfy` CLI.

Everything a script needs is here: the client, the request and status models, and every error
the client raises (all `ClientError`s; `starter.errors` draws their tree).
"""

from starter.batches import BatchSubmitted
from starter.client import JobClient, SubmitOutcome
from starter.connection import connect_temporal
from starter.errors import (
    BatchConflict,
    BatchNotFound,
    BudgetExceeded,
    ClientError,
    ContactLost,
    DrainRefused,
    InputFileError,
    InputNeedsStaging,
    InvalidBatch,
    InvalidJobId,
    InvalidOverride,
    JobAlreadyEnded,
    JobConflict,
    JobNotFound,
    JobUnanswered,
    NamespaceMissing,
    NoPoolQueue,
    QueueFull,
    RequestTooLarge,
    ResumeRefused,
    SearchAttributesMissing,
    SettingsError,
    StorageFailed,
    StorageNotConfigured,
    TemporalRefused,
    TemporalUnreachable,
    UnknownServer,
    UnsafeArtifactKey,
)
from starter.exit import exit_without_finalizing
from starter.requests import load_graph, request_from_files
from workflows.batches import BatchRequest, BatchResults, BatchState, BatchStatus
from workflows.budgets import BudgetUsage
from workflows.contracts import (
    Artifact,
    CancelRequest,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
    ResumeRequest,
    WorkerWait,
)

__all__ = [
    "Artifact",
    "BatchConflict",
    "BatchNotFound",
    "BatchRequest",
    "BatchResults",
    "BatchState",
    "BatchStatus",
    "BatchSubmitted",
    "BudgetExceeded",
    "BudgetUsage",
    "CancelRequest",
    "ClientError",
    "ContactLost",
    "DrainRefused",
    "InputFileError",
    "InputNeedsStaging",
    "InvalidBatch",
    "InvalidJobId",
    "InvalidOverride",
    "JobAlreadyEnded",
    "JobClient",
    "JobConflict",
    "JobNotFound",
    "JobPolicy",
    "JobRequest",
    "JobState",
    "JobStatus",
    "JobUnanswered",
    "NamespaceMissing",
    "NoPoolQueue",
    "QueueFull",
    "RequestTooLarge",
    "ResumeRefused",
    "ResumeRequest",
    "SearchAttributesMissing",
    "SettingsError",
    "StorageFailed",
    "StorageNotConfigured",
    "SubmitOutcome",
    "TemporalRefused",
    "TemporalUnreachable",
    "UnknownServer",
    "UnsafeArtifactKey",
    "WorkerWait",
    "connect_temporal",
    "exit_without_finalizing",
    "load_graph",
    "request_from_files",
]
