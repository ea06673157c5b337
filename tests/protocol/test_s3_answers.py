"""protocol/s3_answers.py: what an S3 answer means, as the worker (activities/storage_errors.py)
and the handler (endpoint/s3.py) both read it, whatever the store's spelling."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from protocol.s3_answers import is_access_refused, is_busy, is_conflict, is_missing


def answer(code: str, status: int) -> ClientError:
    response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "HeadObject")


@pytest.mark.parametrize(
    ("exc", "missing"),
    [
        (answer("NoSuchKey", 404), True),
        # SeaweedFS answers a HEAD with no body: botocore's code is the status.
        (answer("404", 404), True),
        (answer("", 404), True),
        (answer("NoSuchBucket", 403), False),
        (ValueError("NoSuchKey"), False),
    ],
)
def test_missing_is_read_from_the_code_or_the_status(exc: Exception, missing: bool) -> None:
    assert is_missing(exc) is missing


@pytest.mark.parametrize(
    ("exc", "conflict"),
    [
        (answer("PreconditionFailed", 412), True),
        (answer("ConditionalRequestConflict", 409), True),
        (answer("", 412), True),
        (answer("NoSuchKey", 404), False),
    ],
)
def test_a_conditional_write_that_lost_is_a_conflict(exc: Exception, conflict: bool) -> None:
    assert is_conflict(exc) is conflict


@pytest.mark.parametrize(
    ("exc", "busy"),
    [
        (answer("SlowDown", 503), True),
        (answer("ThrottlingException", 400), True),
        (answer("RequestTimeout", 400), True),
        (answer("", 429), True),
        (answer("InternalError", 500), True),
        (answer("AccessDenied", 403), False),
        (answer("PreconditionFailed", 412), False),
        (answer("InvalidArgument", 400), False),
    ],
)
def test_busy_means_not_now(exc: Exception, busy: bool) -> None:
    assert is_busy(exc) is busy


def test_a_refused_key_or_bucket_is_the_operators_to_fix() -> None:
    assert is_access_refused(answer("SignatureDoesNotMatch", 403))
    assert is_access_refused(answer("NoSuchBucket", 404))
    assert not is_access_refused(answer("SlowDown", 503))
