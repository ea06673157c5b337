"""Client side of durable-comfy: the `JobClient` library and the `durable-comfy` CLI."""

from starter.client import JobClient
from starter.connection import connect_temporal
from starter.errors import ClientError, InputFileError, JobNotFound
from starter.requests import load_graph, request_from_files
from workflows.contracts import (
    Artifact,
    JobPolicy,
    JobRequest,
    JobState,
    JobStatus,
)

__all__ = [
    "Artifact",
    "ClientError",
    "InputFileError",
    "JobClient",
    "JobNotFound",
    "JobPolicy",
    "JobRequest",
    "JobState",
    "JobStatus",
    "connect_temporal",
    "load_graph",
    "request_from_files",
]
