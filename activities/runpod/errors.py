"""What can go wrong talking to RunPod's serverless API, as types the caller can branch on.

    RunPodError                     base; `.retryable`: whether asking again later may help
    ├── RunPodAuthError             401/403: the key is missing, wrong, or has no access
    ├── RunPodRefused               any other 4xx: the platform said no, and will again
    │   ├── RunPodRequestTooLarge   a `/run` body over 10 MB (refused before sending) or a 413
    │   └── RunPodPolicyError       a policy outside the platform's ranges (refused before sending)
    ├── RunPodJobGone               404 on a job: TTL expired, result expired, or no such id
    ├── RunPodUnavailable           5xx, transport errors, unreadable answers: retry later
    │   └── RunPodRateLimited       429 beyond the client's own waiting budget; `.retry_after`
    └── RunPodSubmissionAmbiguous   `/run` was sent and its answer lost: a job may exist

`RunPodSubmissionAmbiguous` is deliberately not a `RunPodUnavailable`: `/run` has no idempotency
key, so an `except RunPodUnavailable: try again` must never resubmit a job that may be running.
Every refusal of `/run` (auth, 4xx, 429, 5xx on reads, a connection never made) means no job.

Messages name the endpoint, the route and the status, never the API key: they end up in logs and
in Temporal history.
"""

from __future__ import annotations


class RunPodError(Exception):
    """Base of every error talking to RunPod."""

    retryable = False


class RunPodAuthError(RunPodError):
    """401/403. Fatal: no retry brings a key. The message says which variable to set."""

    def __init__(self, message: str, status_code: int, variable: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.variable = variable


class RunPodRefused(RunPodError):
    """The request was refused; `status_code` is None when refused here, before sending."""

    def __init__(self, message: str, status_code: int | None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RunPodRequestTooLarge(RunPodRefused):
    """`/run` takes at most 10 MB: larger inputs go to S3 and travel by reference."""

    def __init__(self, message: str, size: int, limit: int, status_code: int | None) -> None:
        super().__init__(message, status_code)
        self.size = size
        self.limit = limit


class RunPodPolicyError(RunPodRefused):
    """An `executionTimeout` or `ttl` outside what RunPod accepts (5 s-7 days, 10 s-7 days)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None)


class RunPodJobGone(RunPodError):
    """RunPod no longer knows the job: its TTL expired (a hard limit, counted from submission),
    its result's retention ran out (30 min after completion), or the id was never RunPod's."""

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class RunPodUnavailable(RunPodError):
    """Could not get a usable answer: worth asking again later."""

    retryable = True


class RunPodRateLimited(RunPodUnavailable):
    """429 for longer than the client waits by itself; `retry_after` is RunPod's hint (s)."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RunPodSubmissionAmbiguous(RunPodError):
    """`/run` left this process and no readable answer came back (a read timeout, a reset
    connection, a 5xx from a proxy that may have passed it on, a garbled 200).

    A job may exist and be billed. Not retryable by the client: whether to submit again is the
    workflow's decision (safe with claims, a person's without).
    """
