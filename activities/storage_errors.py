"""The one place botocore's errors become the storage tree (workflows.errors' `StorageError`).

Messages name the operation, bucket, key and S3 error code, never a credential or a presigned URL:
they end up in Temporal history.
"""

from __future__ import annotations

import asyncio

import aiohttp
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    NoCredentialsError,
    PartialCredentialsError,
)

from protocol.s3_answers import (
    MISSING_CODES,
    code_of,
    is_access_refused,
    is_busy,
    is_conflict,
    status_of,
)
from workflows.errors import ObjectMissing, StorageConfigError, StorageError

# BadDigest: the bytes the store received are not the ones we hashed (damaged on the way). A
# conditional write that lost a race is tried again too: the next try reads the new state.
_RETRYABLE_CODES = frozenset({"BadDigest"})

# What talking to S3 can raise. Anything else is a bug and propagates untranslated.
S3_FAILURES: tuple[type[Exception], ...] = (
    ClientError,
    BotoCoreError,
    aiohttp.ClientError,
    OSError,
    asyncio.TimeoutError,
)


def translate(exc: Exception, op: str, bucket: str, key: str) -> StorageError:
    """Map one of `S3_FAILURES` to the tree; use as `raise translate(...) from exc`."""
    where = f"S3 {op} s3://{bucket}/{key}"
    if isinstance(exc, ClientError):
        code, status = code_of(exc), status_of(exc)
        message = f"{where} failed: {code} (HTTP {status})"
        # By code alone: a 404 for anything but the object (NoSuchUpload, NoSuchBucket) is not
        # an object that is missing.
        if code in MISSING_CODES:
            return ObjectMissing(message)
        if is_access_refused(exc):
            return StorageConfigError(f"{message}: check the credentials, bucket and endpoint")
        retryable = is_busy(exc) or is_conflict(exc) or status == 408 or code in _RETRYABLE_CODES
        return StorageError(message, retryable=retryable)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return StorageConfigError(f"{where}: no usable S3 credentials")
    return StorageError(f"{where} failed: {type(exc).__name__}: {exc}", retryable=True)
