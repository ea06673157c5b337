"""What Temporal's own record says about a job, for when the job itself cannot say.

A workflow terminated or timed out from outside never runs its ending, so its last `status`
answer stays non-terminal forever; and with no worker, nobody answers the query at all. The
execution's description (status, search attributes, times) still holds the essentials.
"""

from __future__ import annotations

from temporalio.client import WorkflowExecutionDescription, WorkflowExecutionStatus

from workflows.contracts import JobError, JobState, JobStatus, Progress, UnknownState
from workflows.shared import PROGRESS_KEY, STATE_KEY

# Error types of the states only a client reports (the job never sets them itself).
ERROR_TERMINATED = "Terminated"
ERROR_TIMED_OUT = "TimedOut"

ENDED_FROM_OUTSIDE = {
    WorkflowExecutionStatus.TERMINATED: (
        JobState.TERMINATED,
        ERROR_TERMINATED,
        "terminated from outside: teardown did not run, so its prompt may still be on the "
        "backend; use cancel, not terminate",
    ),
    WorkflowExecutionStatus.TIMED_OUT: (
        JobState.TIMED_OUT,
        ERROR_TIMED_OUT,
        "timed out by a Temporal run or execution timeout set from outside: teardown did not "
        "run, so its prompt may still be on the backend; use the job's "
        "policy.execution_timeout_s instead",
    ),
}


def ended_from_outside(
    job_id: str, description: WorkflowExecutionDescription, last: JobStatus | None
) -> JobStatus | None:
    """`last` as TERMINATED or TIMED_OUT when Temporal ended the workflow from outside."""
    if description.status not in ENDED_FROM_OUTSIDE:
        return None
    state, error_type, message = ENDED_FROM_OUTSIDE[description.status]
    base = last or bare_status(job_id, description)
    return base.model_copy(
        update={
            "state": state,
            "error": JobError(type=error_type, message=message),
            "updated_at": description.close_time or base.updated_at,
        }
    )


def bare_status(job_id: str, description: WorkflowExecutionDescription) -> JobStatus:
    """What Temporal's record holds without the job's help: search attributes and times."""
    attributes = description.typed_search_attributes
    percent = attributes.get(PROGRESS_KEY)
    recorded = attributes.get(STATE_KEY)
    # A state a newer worker recorded is shown by its name, never as QUEUED; it has ended when
    # the workflow has.
    closed = description.status not in (None, WorkflowExecutionStatus.RUNNING)
    state: JobState | UnknownState = JobState.QUEUED
    if recorded:
        state = JobState(recorded) if recorded in JobState.__members__ else UnknownState(recorded)
    if description.status == WorkflowExecutionStatus.CANCELED:
        state = JobState.CANCELLED
    progress = Progress(fraction=min(1.0, max(0.0, percent / 100)) if percent else 0.0)
    return JobStatus.model_validate(
        {
            "job_id": job_id,
            "state": state,
            "terminal": closed,
            "progress": progress,
            "created_at": description.start_time,
            "updated_at": description.close_time,
        }
    )
