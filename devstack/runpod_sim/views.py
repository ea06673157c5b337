"""How a job looks through RunPod's public API (/status, /runsync, webhooks)."""

from __future__ import annotations

from typing import Any

from .jobs import Job


def ms(seconds: float) -> int:
    return round(seconds * 1000)


def status_body(job: Job) -> dict[str, Any]:
    """`{id, status, delayTime, executionTime, output | error, workerId}`: delayTime and workerId
    once a worker took the job, executionTime once it ended; while IN_PROGRESS, `output` is the
    latest progress update; once ended, `output` and `error` are what the worker sent."""
    body: dict[str, Any] = {"id": job.id, "status": job.status}
    if job.started_at is not None:
        body["delayTime"] = ms(job.started_at - job.queued_at)
        body["workerId"] = job.worker_id
        if job.terminal and job.finished_at is not None:
            body["executionTime"] = ms(job.finished_at - job.started_at)
    if job.status == "IN_PROGRESS" and job.has_progress:
        body["output"] = job.progress
    if job.terminal:
        if job.has_output:
            body["output"] = job.output
        if job.error is not None:
            body["error"] = job.error
    return body
