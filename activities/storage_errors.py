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

from workflows.errors import ObjectMissing, StorageConfigError, StorageError

MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_CONFIG_CODES = frozenset(
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
# BadDigest: the bytes the store received are not the ones we hashed (damaged on the way).
_RETRYABLE_CODES = frozenset(
    {"RequestTimeout", "SlowDown", "PreconditionFailed", "Throttling", "BadDigest"}
)

# What talking to S3 can raise. Anything else is a bug and propagates untranslated.
S3_FAILURES: tuple[type[Exception], ...] = (
    ClientError,
    BotoCoreError,
    aiohttp.ClientError,
    OSError,
    asyncio.TimeoutError,
)


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def translate(exc: Exception, op: str, bucket: str, key: str) -> StorageError:
    """Map one of `S3_FAILURES` to the tree; use as `raise translate(...) from exc`."""
    where = f"S3 {op} s3://{bucket}/{key}"
    if isinstance(exc, ClientError):
        code = error_code(exc)
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        message = f"{where} failed: {code} (HTTP {status})"
        if code in MISSING_CODES:
            return ObjectMissing(message)
        if code in _CONFIG_CODES:
            return StorageConfigError(f"{message}: check the credentials, bucket and endpoint")
        retryable = status >= 500 or status in (408, 409, 412, 429) or code in _RETRYABLE_CODES
        return StorageError(message, retryable=retryable)
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return StorageConfigError(f"{where}: no usable S3 credentials")
    return StorageError(f"{where} failed: {type(exc).__name__}: {exc}", retryable=True)
