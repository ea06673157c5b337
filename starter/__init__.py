"""Client side of durable-comfy: the `JobClient` library and the `durable-comfy` CLI."""

from starter.client import JobClient
from starter.connection import connect_temporal
from starter.errors import ClientError, ContactLost, InputFileError, JobNotFound
from starter.requests import load_graph, request_from_files
from workflows.contracts import (
    Artifact,
    CancelRequest,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
    ResumeRequest,
)

__all__ = [
    "Artifact",
    "CancelRequest",
    "ClientError",
    "ContactLost",
    "InputFileError",
    "JobClient",
    "JobNotFound",
    "JobPolicy",
    "JobRequest",
    "JobState",
    "JobStatus",
    "ResumeRequest",
    "connect_temporal",
    "load_graph",
    "request_from_files",
]
