"""activities/storage_errors.py: botocore's answers into the storage tree, read through
protocol/s3_answers.py as the handler reads them. What the handler rides out (endpoint/s3.py's
`is_transient`), the worker retries; a missing object or a refused key is not retried."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from activities.storage_errors import translate
from endpoint.s3 import is_transient
from workflows.errors import ObjectMissing, StorageConfigError


def answer(code: str, status: int) -> ClientError:
    response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(response, "PutObject")


@pytest.mark.parametrize(
    "code", ["SlowDown", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout"]
)
def test_what_the_handler_rides_out_the_worker_retries(code: str) -> None:
    exc = answer(code, 400)
    assert is_transient(exc)
    assert translate(exc, "put", "b", "k").retryable


def test_the_worker_translates_a_missing_object_and_a_refused_key() -> None:
    assert isinstance(translate(answer("404", 404), "head", "b", "k"), ObjectMissing)
    refused = translate(answer("InvalidAccessKeyId", 403), "put", "b", "k")
    assert isinstance(refused, StorageConfigError)
    assert "check the credentials" in str(refused)
    # A conditional copy that lost to a retried try of its own reads the new state next time.
    assert translate(answer("PreconditionFailed", 412), "copy", "b", "k").retryable
    assert not translate(answer("InvalidArgument", 400), "put", "b", "k").retryable
