"""The one place RunPod errors and failed jobs become `ApplicationError`s the workflow reads.

What each means for the workflow (`workflows.failures.classify` reads the retryable flag and
the type):

    RunPodUnavailable, RunPodRateLimited  BackendUnavailable, retryable (Retry-After as the next
                                          retry's delay): reconnect and poll again
    RunPodAuthError                       BackendError, fatal: a person sets the variable
    RunPodRefused                         BackendError, fatal
    RunPodRequestTooLarge, policy ranges  InvalidRequest, fatal
    RunPodJobGone                         PromptLost: submit again (use `outcome.read_gone`
                                          first when the last state seen is known)
    RunPodSubmissionAmbiguous             SubmissionAmbiguous, fatal for the activity: the
                                          workflow resubmits the same submission token when the
                                          pool has claims, and asks a person when it has not
    Failed (outcome.py)                   its own type, fatal; `resubmit` ones as PromptLost
"""

from __future__ import annotations

from typing import Any

from temporalio.exceptions import ApplicationError

from activities.errors import fatal, retryable
from activities.runpod.outcome import Failed
from workflows.contracts import JobCost
from workflows.errors import (
    RunPodAuthError,
    RunPodError,
    RunPodJobGone,
    RunPodPolicyError,
    RunPodRateLimited,
    RunPodRefused,
    RunPodRequestTooLarge,
    RunPodSubmissionAmbiguous,
    RunPodUnavailable,
)
from workflows.shared import ErrorType


def from_runpod(exc: RunPodError, doing: str) -> ApplicationError:
    message = f"{doing}: {exc}"
    if isinstance(exc, RunPodRateLimited):
        return retryable(ErrorType.BACKEND_UNAVAILABLE, message, next_retry_delay=exc.retry_after)
    if isinstance(exc, RunPodUnavailable):
        return retryable(ErrorType.BACKEND_UNAVAILABLE, message)
    if isinstance(exc, RunPodSubmissionAmbiguous):
        return fatal(ErrorType.SUBMISSION_AMBIGUOUS, message)
    if isinstance(exc, RunPodJobGone):
        return fatal(ErrorType.PROMPT_LOST, message, provider_job_id=exc.job_id)
    if isinstance(exc, RunPodAuthError):
        return fatal(
            ErrorType.BACKEND_ERROR, message, status_code=exc.status_code, variable=exc.variable
        )
    if isinstance(exc, RunPodRequestTooLarge):
        return fatal(ErrorType.INVALID_REQUEST, message, size=exc.size, limit=exc.limit)
    if isinstance(exc, RunPodPolicyError):
        return fatal(ErrorType.INVALID_REQUEST, message)
    if isinstance(exc, RunPodRefused):
        return fatal(ErrorType.BACKEND_ERROR, message, status_code=exc.status_code)
    return fatal(ErrorType.BACKEND_ERROR, message)


def from_failure(failed: Failed, cost: JobCost | None = None) -> ApplicationError:
    """A failed job as the activity's failure. A worker's failure (`resubmit`) is `PromptLost`,
    which the workflow answers by submitting again; its own type stays in the details, and so
    does `cost`, what the failed RunPod job was billed (a crashed delivery is paid for too,
    though the job goes on under another RunPod job; `workflows.failures.failure_cost`)."""
    details: dict[str, Any] = {
        "provider_job_id": failed.job_id,
        "runpod_status": failed.state,
        "cause_type": failed.error_type,
        "refresh_worker": failed.refresh_worker,
        "worker_id": failed.worker_id,
    }
    if cost is not None:
        details["cost"] = cost.model_dump(mode="json")
    if failed.retryable:
        return retryable(failed.error_type, failed.message, **details)
    error_type = ErrorType.PROMPT_LOST if failed.resubmit else failed.error_type
    return fatal(error_type, failed.message, **details)
