"""Running and watching jobs the way a user does (`JobClient`), with the times a benchmark needs."""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from typing import Any

from pydantic import BaseModel

from faults.graphs import sampler_graph
from starter import JobClient, JobRequest
from starter.errors import TemporalUnreachable
from workflows.contracts import JobState, JobStatus, ReadState


class BenchFailure(RuntimeError):
    """The system under measurement did not do the work: no figure is better than a wrong one."""


def graph(steps: int) -> dict[str, Any]:
    """examples/txt2img.json with `steps` sampler steps and a seed no earlier prompt used (the
    simulator, like ComfyUI, serves an unchanged node from its cache without running it)."""
    return sampler_graph(steps)


class Seen(BaseModel):
    """One status a watching client was handed, and when (epoch seconds)."""

    at: float
    state: ReadState
    step: int
    total_steps: int


def completed(status: JobStatus) -> JobStatus:
    if status.state != JobState.COMPLETED:
        raise BenchFailure(f"job {status.job_id} ended {status.state.value}: {status.error}")
    return status


async def watch(
    jobs: JobClient,
    job_id: str,
    seen: list[Seen] | None = None,
    since: JobStatus | None = None,
) -> tuple[list[Seen], JobStatus]:
    """Follow the job with `JobClient.watch` at its default poll interval, as the CLI does
    (`since`: the status its submit answered, as `submit --watch` passes it); each status is
    appended to `seen` (readable while the job runs) as it arrives."""
    seen = [] if seen is None else seen
    last: JobStatus | None = None
    async for status in jobs.watch(job_id, since=since):
        seen.append(
            Seen(
                at=time.time(),
                state=status.state,
                step=status.progress.step,
                total_steps=status.progress.total_steps,
            )
        )
        last = status
    if last is None:
        raise BenchFailure(f"watching {job_id} yielded nothing")
    return seen, completed(last)


def prompt_id_of(status: JobStatus) -> str:
    if status.backend is not None and status.backend.provider_job_id:
        return status.backend.provider_job_id
    if status.checkpoint is not None and status.checkpoint.prompt_id:
        return status.checkpoint.prompt_id
    raise BenchFailure(f"job {status.job_id} names no prompt")


def request(steps: int, pool: str) -> JobRequest:
    return JobRequest(graph=graph(steps), pool=pool)


def _default_poll_s() -> float:
    default = inspect.signature(JobClient.watch).parameters["poll_interval_s"].default
    return float(default)


# What `watch` (and the CLI) polls at unless told otherwise: read from the library, not copied.
DEFAULT_POLL_S = _default_poll_s()


# A burst of a thousand starts can outrun the dev server (SQLite): a start that timed out is
# sent again under the same job ID, which starts nothing twice (an idempotent submit).
SUBMIT_ATTEMPTS = 5


async def submit_idempotently(
    jobs: JobClient, job_request: JobRequest, *, detached: bool = True
) -> JobStatus:
    """`JobClient.submit` under a job ID of our own, sent again while Temporal times out, as a
    careful client does."""
    job_id = f"bench-{uuid.uuid4().hex}"
    for attempt in range(SUBMIT_ATTEMPTS):
        try:
            return await jobs.submit(job_request, job_id=job_id, detached=detached)
        except TemporalUnreachable:
            if attempt + 1 == SUBMIT_ATTEMPTS:
                raise
            await asyncio.sleep(2.0 * (attempt + 1))
    raise AssertionError("unreachable")
