"""The public API's request bodies and the job states, as RunPod defines them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

JobStatus = Literal["IN_QUEUE", "IN_PROGRESS", "COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"]
TERMINAL: frozenset[str] = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"})
RETRYABLE: frozenset[str] = frozenset({"FAILED", "TIMED_OUT"})

_SECOND_MS = 1000
_WEEK_MS = 7 * 24 * 3600 * _SECOND_MS


class Policy(BaseModel):
    """`policy` of /run and /runsync; RunPod's ranges: executionTimeout 5 s-7 days, ttl 10 s-7
    days (both ms). lowPriority is accepted and has no effect here."""

    model_config = ConfigDict(extra="ignore")

    executionTimeout: int | None = Field(default=None, ge=5 * _SECOND_MS, le=_WEEK_MS)
    ttl: int | None = Field(default=None, ge=10 * _SECOND_MS, le=_WEEK_MS)
    lowPriority: bool = False


class RunRequest(BaseModel):
    # Tolerant: RunPod accepts more top-level fields (s3Config, ...) than the simulator uses.
    model_config = ConfigDict(extra="ignore")

    input: Any = Field(...)
    policy: Policy | None = None
    webhook: str | None = None


def submission_token(job_input: Any) -> str | None:
    """`input.durable_comfy.submission` when present: the ledger groups GPU runs by it."""
    if not isinstance(job_input, dict):
        return None
    block = job_input.get("durable_comfy")
    if not isinstance(block, dict):
        return None
    token = block.get("submission")
    return token if isinstance(token, str) else None
