"""`workflows/failures.py` on its own: how an activity failure is classified and reported.

`classify` decides what the job does next (re-attach, resubmit, stop, fail); `job_error` is
the error a client sees in the status.
"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.exceptions import (
    ApplicationError,
    CancelledError,
    TimeoutError,
    TimeoutType,
)

from tests.support.workflow_fakes import after_activity
from workflows.contracts import JobCost, JobError
from workflows.failures import FailureKind, classify, failure_cost, job_error
from workflows.shared import ErrorType


def heartbeat_timeout() -> TimeoutError:
    return TimeoutError(
        "activity heartbeat timeout", type=TimeoutType.HEARTBEAT, last_heartbeat_details=[]
    )


@pytest.mark.parametrize(
    ("err", "kind"),
    [
        (asyncio.CancelledError(), FailureKind.CANCELLED),
        (CancelledError(), FailureKind.CANCELLED),
        (after_activity(CancelledError()), FailureKind.CANCELLED),
        (after_activity(heartbeat_timeout()), FailureKind.RECONNECT),
        (heartbeat_timeout(), FailureKind.RECONNECT),
        (after_activity(ApplicationError("gone", type=ErrorType.PROMPT_LOST)), FailureKind.LOST),
        (
            after_activity(
                ApplicationError("gone", type=ErrorType.PROMPT_LOST, non_retryable=True)
            ),
            FailureKind.LOST,
        ),
        (
            after_activity(ApplicationError("answer lost", type=ErrorType.SUBMISSION_AMBIGUOUS)),
            FailureKind.AMBIGUOUS,
        ),
        (
            after_activity(
                ApplicationError("lost", type=ErrorType.SUBMISSION_AMBIGUOUS, non_retryable=True)
            ),
            FailureKind.AMBIGUOUS,
        ),
        (after_activity(ApplicationError("socket", type="ConnectionLost")), FailureKind.RECONNECT),
        (ApplicationError("socket", type="ConnectionLost"), FailureKind.RECONNECT),
        (
            after_activity(ApplicationError("bad", type="PromptRejected", non_retryable=True)),
            FailureKind.FATAL,
        ),
        (after_activity(RuntimeError("bug")), FailureKind.FATAL),
        (after_activity(None), FailureKind.FATAL),
        (RuntimeError("bug"), FailureKind.FATAL),
    ],
)
def test_classify(err: BaseException, kind: FailureKind) -> None:
    assert classify(err) == kind


def test_an_application_error_is_reported_as_raised() -> None:
    oom = ApplicationError("CUDA out of memory", type="OutOfMemory", non_retryable=True)
    assert job_error(after_activity(oom)) == JobError(
        type="OutOfMemory", message="CUDA out of memory", retryable=False
    )
    untyped = ApplicationError("flaky")
    assert job_error(after_activity(untyped)) == JobError(
        type=ErrorType.EXECUTION_ERROR, message="flaky", retryable=True
    )
    assert job_error(untyped) == job_error(after_activity(untyped))


def test_a_timeout_is_retryable() -> None:
    assert job_error(after_activity(heartbeat_timeout())) == JobError(
        type=ErrorType.TIMEOUT, message="activity heartbeat timeout", retryable=True
    )


def test_anything_else_is_an_execution_error() -> None:
    assert job_error(after_activity(RuntimeError("bug"))) == JobError(
        type=ErrorType.EXECUTION_ERROR, message="bug", retryable=False
    )
    assert job_error(KeyError("k")) == JobError(
        type=ErrorType.EXECUTION_ERROR, message="'k'", retryable=False
    )
    # An activity failure without a cause is reported as itself.
    assert job_error(after_activity(None)) == JobError(
        type=ErrorType.EXECUTION_ERROR, message="activity failed", retryable=False
    )


def test_the_cost_of_a_failed_provider_job_is_read_from_the_failure() -> None:
    cost = JobCost(provider_job_id="rp-1", queue_s=1.0, execution_s=4.5, usd_per_second=0.001)
    details = {"provider_job_id": "rp-1", "cost": cost.model_dump(mode="json")}
    failed = ApplicationError("crashed", details, type=ErrorType.PROMPT_LOST, non_retryable=True)
    assert failure_cost(after_activity(failed)) == cost
    assert (
        failure_cost(after_activity(ApplicationError("no cost", {"provider_job_id": "x"}))) is None
    )
    assert (
        failure_cost(after_activity(ApplicationError("unreadable", {"cost": {"queue_s": "?"}})))
        is None
    )
    assert failure_cost(heartbeat_timeout()) is None


def test_the_error_types_never_change() -> None:
    """Clients branch on these strings and replay histories hold them (histories/*.json): the
    class may move, but a value renamed or dropped breaks both; a new one is added here."""
    assert {k: v for k, v in vars(ErrorType).items() if k.isupper()} == {
        "INVALID_REQUEST": "InvalidRequest",
        "INVALID_GRAPH": "InvalidGraph",
        "UNKNOWN_POOL": "UnknownPool",
        "MISSING_INPUT": "MissingInput",
        "PROMPT_REJECTED": "PromptRejected",
        "BACKEND_UNAVAILABLE": "BackendUnavailable",
        "BACKEND_ERROR": "BackendError",
        "CONNECTION_LOST": "ConnectionLost",
        "EXECUTION_ERROR": "ExecutionError",
        "OUT_OF_MEMORY": "OutOfMemory",
        "BACKEND_FAULT": "BackendFault",
        "INTERRUPTED": "Interrupted",
        "PROMPT_LOST": "PromptLost",
        "SUBMISSION_AMBIGUOUS": "SubmissionAmbiguous",
        "OUTPUT_MISSING": "OutputMissing",
        "STORAGE_ERROR": "StorageError",
        "TIMEOUT": "Timeout",
        "PRIORITY_NOT_ALLOWED": "PriorityNotAllowed",
        "QUEUE_TIMEOUT": "QueueTimeout",
        "EXPIRED": "Expired",
        "TEARDOWN_FAILED": "TeardownFailed",
        "CANCELLED": "Cancelled",
        "RESUME_REFUSED": "ResumeRefused",
        "ABANDONED": "Abandoned",
        "NEVER_STARTED": "NeverStarted",
        "BUDGET_UNKNOWN": "BudgetUnknown",
    }
