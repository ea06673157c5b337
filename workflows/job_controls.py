"""What clients asked of a running job, shared by the message handlers and the work."""

from __future__ import annotations

from dataclasses import dataclass

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts import JobError, JobState, ResumeRequest


@dataclass(frozen=True)
class StopOrder:
    """Why the job stops, and the end state it will have."""

    state: JobState
    error: JobError


@dataclass
class JobControls:
    stop: StopOrder | None = None
    # The reason a Temporal cancel that follows should carry (the `cancel_reason` signal).
    cancel_reason: str | None = None
    # The answer to a NEEDS_DECISION; cleared when a new question is asked.
    resume: ResumeRequest | None = None
    # Prompts submitted again after the backend lost them, over the whole job.
    resubmits: int = 0
    # Of those, the ones nobody was asked about: a backend that cannot run a prompt twice lost
    # its worker (`AT_MOST_ONCE_RESUBMITS` at most).
    unasked_resubmits: int = 0
