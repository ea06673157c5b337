"""The client library's public surface is what we mean it to be, and nothing leaks into it."""

from __future__ import annotations

import starter


def test_starter_exports_exactly_the_public_api() -> None:
    assert sorted(starter.__all__) == [
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
    for name in starter.__all__:
        assert getattr(starter, name) is not None


def test_client_methods_cover_the_job_lifecycle() -> None:
    methods = {"submit", "status", "watch", "wait", "result", "cancel", "resume", "attach"}
    assert methods <= set(dir(starter.JobClient))
