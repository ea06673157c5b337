"""What an S3 error answer means, read one way by the worker (`activities/storage_errors.py`) and
the RunPod handler (`endpoint/s3.py`): an object that is not there, a conditional write that lost,
credentials or a bucket that are wrong, a service that is busy.

S3-compatible stores disagree on the code for one condition (AWS's `NoSuchKey` is SeaweedFS's
`NotFound` on a HEAD, which carries no body, so botocore reports the bare status), so each set
names every spelling and the predicates read the HTTP status too. Both venvs hold botocore, in
versions that cannot share a venv; `ClientError` and its `response` are the same in both.
"""

from __future__ import annotations

from botocore.exceptions import ClientError

MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
# A conditional write whose condition failed (412), or one that raced another (409, AWS).
CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
# Nothing a later try changes: the operator has to fix the credentials, bucket or endpoint.
ACCESS_CODES = frozenset(
    {
        "403",
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AuthorizationHeaderMalformed",
        "InvalidToken",
        "ExpiredToken",
        "NoSuchBucket",
        "InvalidBucketName",
        "PermanentRedirect",
    }
)
# "Not now" rather than "no": throttling, a request the service timed out, a service in trouble.
BUSY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)


def code_of(exc: ClientError) -> str:
    """The answer's S3 error code ("" when the store sent none)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def status_of(exc: ClientError) -> int:
    """The answer's HTTP status (0 when botocore recorded none)."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else 0


def is_missing(exc: BaseException) -> bool:
    if not isinstance(exc, ClientError):
        return False
    return code_of(exc) in MISSING_CODES or status_of(exc) == 404


def is_conflict(exc: BaseException) -> bool:
    if not isinstance(exc, ClientError):
        return False
    return code_of(exc) in CONFLICT_CODES or status_of(exc) in (409, 412)


def is_access_refused(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and code_of(exc) in ACCESS_CODES


def is_busy(exc: BaseException) -> bool:
    if not isinstance(exc, ClientError):
        return False
    status = status_of(exc)
    return status >= 500 or status == 429 or code_of(exc) in BUSY_CODES
