"""The handler's S3 client: boto3 (it comes with runpod), called from worker threads.

One synchronous client per job; botocore clients are thread-safe, and every call goes through
`call` so the event loop (socket, progress, lease renewal) never waits on S3.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from endpoint.settings import BucketSettings

T = TypeVar("T")

# Any failure talking to S3, as botocore raises them.
S3_FAILURES = (BotoCoreError, ClientError)
# Conditional writes: 412 the condition failed; 409 a concurrent conditional write (AWS).
CONFLICT_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412", "409"})
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


class S3:
    """A boto3 S3 client whose calls run in threads: `await s3.call("put_object", ...)`."""

    def __init__(self, settings: BucketSettings) -> None:
        self.settings = settings
        self.client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            aws_access_key_id=settings.access_key_id.get_secret_value(),
            aws_secret_access_key=settings.secret_access_key.get_secret_value(),
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": settings.addressing_style},
                # A couple of quick retries for a flaky link; the lease loop and the platform
                # own the longer ones.
                retries={"max_attempts": 3, "mode": "standard"},
                connect_timeout=5,
                read_timeout=60,
                max_pool_connections=16,
            ),
        )

    async def call(self, operation: str, **kwargs: Any) -> Any:
        method = getattr(self.client, operation)
        return await asyncio.to_thread(functools.partial(method, **kwargs))

    async def run(self, blocking: Callable[..., T], *args: Any) -> T:
        """Other blocking work on what a call returned (reading a streamed body)."""
        return await asyncio.to_thread(blocking, *args)


def error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code or str(status or "")
    return type(exc).__name__


def is_conflict(exc: BaseException) -> bool:
    if not isinstance(exc, ClientError):
        return False
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return error_code(exc) in CONFLICT_CODES or status in (409, 412)


def is_missing(exc: BaseException) -> bool:
    if not isinstance(exc, ClientError):
        return False
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return error_code(exc) in MISSING_CODES or status == 404
