"""RunPod's serverless API as typed models: the answers we read and the `/run` policy we send.

Answers are read tolerantly (unknown fields ignored, optional fields optional): the platform
adds fields, and a stock endpoint fills fewer. Python names are snake_case; the wire's camelCase
names are the aliases (`delayTime` -> `delay_time_ms`, both in milliseconds as RunPod sends them).
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from configuration.pools import ENDPOINT_ID_PATTERN as ENDPOINT_ID_PATTERN
from configuration.pools import MAX_POLICY_S as MAX_POLICY_S
from configuration.pools import MIN_EXECUTION_TIMEOUT_S as MIN_EXECUTION_TIMEOUT_S
from workflows.errors import RunPodPolicyError

# RunPod's job ids ("<uuid>-u1", "sync-<uuid>-e1"). Checked before an id goes into a URL path:
# ids also arrive from outputs (a claim holder), which are untrusted.
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,199}$")

# `/run` policy ranges (PROTOCOLS.md; the execution timeout's and the longest are
# configuration.pools', which checks a pool's against them): outside them the platform refuses
# the job.
MIN_TTL_S = 10.0
# RunPod's own ttl when none is sent: how long a job may wait when the job sets no queue limit.
DEFAULT_QUEUE_WAIT_S = 24 * 3600.0


class RunPodState(StrEnum):
    IN_QUEUE = "IN_QUEUE"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def terminal(self) -> bool:
        return self not in (RunPodState.IN_QUEUE, RunPodState.IN_PROGRESS)


def is_job_id(value: object) -> bool:
    return isinstance(value, str) and JOB_ID_PATTERN.match(value) is not None


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True)


class RunPodJob(_Answer):
    """`/status/{id}` (and the `{id, status}` of `/run`, `/cancel`, `/retry`).

    `output` is the handler's return value once COMPLETED and the latest `progress_update`
    payload while IN_PROGRESS; `error` is set on FAILED (a string, often JSON from the SDK).
    """

    id: str
    # A string, not `RunPodState`: a state the platform adds later must not make every status
    # answer unreadable. `state` says which known state it is.
    status: str
    delay_time_ms: float | None = Field(None, alias="delayTime")
    execution_time_ms: float | None = Field(None, alias="executionTime")
    worker_id: str | None = Field(None, alias="workerId")
    output: Any = None
    error: Any = None

    @property
    def state(self) -> RunPodState | None:
        try:
            return RunPodState(self.status)
        except ValueError:
            return None


class StreamChunk(_Answer):
    output: Any = None


class RunPodStream(_Answer):
    """`/stream/{id}`: what a generator handler yielded since the last call."""

    status: str | None = None
    stream: list[StreamChunk] = Field(default_factory=list)
    error: Any = None


class HealthJobs(_Answer):
    completed: int = 0
    failed: int = 0
    in_progress: int = Field(0, alias="inProgress")
    in_queue: int = Field(0, alias="inQueue")
    retried: int = 0


class HealthWorkers(_Answer):
    idle: int = 0
    initializing: int = 0
    ready: int = 0
    running: int = 0
    throttled: int = 0
    unhealthy: int = 0


class RunPodHealth(_Answer):
    jobs: HealthJobs = Field(default_factory=HealthJobs)
    workers: HealthWorkers = Field(default_factory=HealthWorkers)


class RunPodPurged(_Answer):
    """`/purge-queue`: how many queued jobs were removed (running ones are not touched)."""

    removed: int = 0
    status: str = ""


class RunPolicy(BaseModel):
    """`/run`'s `policy`: milliseconds on the wire, within the platform's ranges."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True)

    execution_timeout_ms: int = Field(
        alias="executionTimeout",
        ge=int(MIN_EXECUTION_TIMEOUT_S * 1000),
        le=int(MAX_POLICY_S * 1000),
    )
    ttl_ms: int = Field(alias="ttl", ge=int(MIN_TTL_S * 1000), le=int(MAX_POLICY_S * 1000))

    @classmethod
    def for_job(cls, execution_timeout_s: float, queue_timeout_s: float | None) -> RunPolicy:
        """The policy of a job that may wait `queue_timeout_s` (None: RunPod's 24 h) and then
        run `execution_timeout_s`.

        RunPod's ttl is a hard limit counted from submission, queue wait *and* execution: a ttl
        of only the queue timeout would delete a job mid-run. So ttl = queue + execution. The
        orchestrator enforces the queue timeout itself (it cancels a job still queued); the ttl
        is the platform's backstop for when the orchestrator is gone.
        """
        if not MIN_EXECUTION_TIMEOUT_S <= execution_timeout_s <= MAX_POLICY_S:
            raise RunPodPolicyError(
                f"execution timeout {execution_timeout_s:g} s is outside RunPod's range "
                f"({MIN_EXECUTION_TIMEOUT_S:g} s to 7 days)"
            )
        if queue_timeout_s is None:
            # Nothing asked: RunPod's default wait, shortened only where the sum passes 7 days.
            ttl_s = min(DEFAULT_QUEUE_WAIT_S + execution_timeout_s, MAX_POLICY_S)
        else:
            ttl_s = queue_timeout_s + execution_timeout_s
            if not MIN_TTL_S <= ttl_s <= MAX_POLICY_S:
                raise RunPodPolicyError(
                    f"ttl = queue timeout {queue_timeout_s:g} s + execution timeout "
                    f"{execution_timeout_s:g} s = {ttl_s:g} s is outside RunPod's range "
                    f"({MIN_TTL_S:g} s to 7 days)"
                )
        return cls(
            execution_timeout_ms=math.ceil(execution_timeout_s * 1000),
            ttl_ms=min(math.ceil(ttl_s * 1000), int(MAX_POLICY_S * 1000)),
        )

    def wire(self) -> dict[str, int]:
        return {"executionTimeout": self.execution_timeout_ms, "ttl": self.ttl_ms}
