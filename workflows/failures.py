"""Reading activity failures: what kind of failure, what to tell the client, where we got to."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from pydantic import ValidationError
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    TimeoutError,
    is_cancelled_exception,
)

from workflows.activity_io import FollowHeartbeat
from workflows.contracts import Artifact, Checkpoint, JobCost, JobError
from workflows.errors import GraphFormatError
from workflows.shared import AT_MOST_ONCE, ErrorType


class FailureKind(StrEnum):
    RECONNECT = "reconnect"  # the path to the backend broke: back off, re-attach
    LOST = "lost"  # the backend provably lost the prompt: submit it again
    # A submission whose answer was lost, on a backend that cannot tell whether it took it
    # (RunPod without claims): submitting again may pay twice, so the policy decides.
    AMBIGUOUS = "ambiguous"
    CANCELLED = "cancelled"
    FATAL = "fatal"  # bad input, a failed prompt: no retry can help


def classify(err: BaseException) -> FailureKind:
    if is_cancelled_exception(err):
        return FailureKind.CANCELLED
    cause = err.cause if isinstance(err, ActivityError) else err
    if isinstance(cause, TimeoutError):
        # A worker that died mid-follow stops heartbeating: its replacement re-attaches.
        return FailureKind.RECONNECT
    if isinstance(cause, ApplicationError):
        if cause.type == ErrorType.PROMPT_LOST:
            return FailureKind.LOST
        if cause.type == ErrorType.SUBMISSION_AMBIGUOUS:
            return FailureKind.AMBIGUOUS
        if not cause.non_retryable:
            return FailureKind.RECONNECT
    return FailureKind.FATAL


def resubmit_cannot_run_twice(err: BaseException) -> bool:
    """Whether a lost prompt's backend guarantees it runs at most once however often it is
    submitted (a RunPod pool with claims: a new delivery takes the claim over or finds it
    finished). Its losses are a worker dying, not a question for a person."""
    cause = err.cause if isinstance(err, ActivityError) else err
    if not isinstance(cause, ApplicationError):
        return False
    return any(isinstance(d, Mapping) and d.get(AT_MOST_ONCE) is True for d in cause.details)


def job_error(err: BaseException) -> JobError:
    cause = err.cause if isinstance(err, ActivityError) and err.cause is not None else err
    if isinstance(cause, ApplicationError):
        return JobError(
            type=cause.type or ErrorType.EXECUTION_ERROR,
            message=cause.message,
            retryable=not cause.non_retryable,
        )
    if isinstance(cause, TimeoutError):
        return JobError(type=ErrorType.TIMEOUT, message=str(cause), retryable=True)
    return JobError(type=ErrorType.EXECUTION_ERROR, message=str(cause), retryable=False)


def work_error(err: BaseException) -> JobError:
    """The error of a job whose work failed (not stopped: an order says its own)."""
    if isinstance(err, GraphFormatError):
        # A segment's overrides that do not fit the graph (a request prepare did not see).
        return JobError(type=ErrorType.INVALID_REQUEST, message=str(err))
    return job_error(err)


def failure_cost(err: BaseException) -> JobCost | None:
    """What the provider job of a failed attempt cost, when the failure says (a RunPod job
    that failed or whose worker crashed: the job may go on under another provider job, and
    this one is paid for all the same). None when it does not say or cannot be read."""
    cause = err.cause if isinstance(err, ActivityError) else err
    if not isinstance(cause, ApplicationError) or not cause.details:
        return None
    first = cause.details[0]
    if not isinstance(first, Mapping) or not isinstance(first.get("cost"), Mapping):
        return None
    try:
        return JobCost.model_validate(first["cost"])
    except ValidationError:
        return None


def recovered_progress(err: BaseException) -> tuple[Checkpoint | None, list[Artifact]]:
    """The checkpoint and stored artifacts a failed follow attempt left behind, if any.

    They come back as the failure's details, or as the last heartbeat after a worker died, in
    either form `FollowHeartbeat.from_details` reads.
    """
    cause = err.cause if isinstance(err, ActivityError) else err
    details: Sequence[Any] = ()
    if isinstance(cause, ApplicationError):
        details = cause.details
    elif isinstance(cause, TimeoutError):
        details = cause.last_heartbeat_details
    heartbeat = FollowHeartbeat.from_details(details)
    if heartbeat is None:
        return None, []
    return heartbeat.checkpoint, heartbeat.artifacts


# Set in a refusal's details by the follow attempt that checked the request first (a request
# that stages nothing is checked there, not in a prepare of its own): nothing was submitted.
REFUSED_BEFORE_SUBMISSION = "refused_before_submission"


def as_refused_before_submission(refusal: ApplicationError) -> ApplicationError:
    """The same refusal (type, message, details), marked as made before anything was sent."""
    return ApplicationError(
        refusal.message,
        *refusal.details,
        {REFUSED_BEFORE_SUBMISSION: True},
        type=refusal.type,
        non_retryable=True,
    )


def refused_before_submission(err: BaseException | None) -> bool:
    """Whether the job failed on its request's check, before anything was submitted."""
    cause = err.cause if isinstance(err, ActivityError) else err
    if not isinstance(cause, ApplicationError) or not cause.non_retryable:
        return False
    return any(
        isinstance(d, Mapping) and d.get(REFUSED_BEFORE_SUBMISSION) is True for d in cause.details
    )
