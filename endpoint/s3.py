"""The handler's S3 client: boto3 (it comes with runpod), called from worker threads, every call
retried through a storage outage.

One synchronous client per job; botocore clients are thread-safe, and every call goes through
`call` so the event loop (socket, progress, lease renewal) never waits on S3.

A finished GPU run must not be lost to a bucket that is down for a minute: a call that fails
with something that can recover (no connection, a timeout, a 5xx, throttling) is tried again with
jittered exponential backoff until `retry_s` (BUCKET_RETRY_S) has passed since its first failure,
instead of botocore's few quick attempts. An answer (404, 403, 412...) is returned at once: the
claim protocol depends on a 412 meaning someone else's write. Several calls may share one
`Patience`, so a whole output file is bounded by one budget.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
import structlog
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from endpoint.settings import BucketSettings
from protocol.s3_answers import is_busy

log = structlog.get_logger(__name__)

T = TypeVar("T")

# Any failure talking to S3, as botocore raises them.
S3_FAILURES = (BotoCoreError, ClientError)
# No connection, a connection cut or a timeout: the service may be back in a moment.
TRANSIENT_BOTO = (BotoConnectionError, HTTPClientError, IncompleteReadError)
DEFAULT_RETRY_S = 300.0
FIRST_DELAY_S = 0.5
MAX_DELAY_S = 5.0


def is_transient(exc: BaseException) -> bool:
    """True for a failure a later try can get past (an outage), False for an answer."""
    if isinstance(exc, TRANSIENT_BOTO):
        return True
    return is_busy(exc)


class Patience:
    """How long a call (or several calls doing one thing) keeps trying: `budget_s` from the first
    failure, waiting a jittered, doubling delay between tries."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.failures = 0
        self._deadline: float | None = None
        self._delay = FIRST_DELAY_S

    def next_wait(self) -> float | None:
        """Seconds to wait before the next try, or None once the budget is spent."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.budget_s
        self.failures += 1
        left = self._deadline - now
        if left <= 0:
            return None
        wait = random.uniform(self._delay / 2, self._delay)
        self._delay = min(self._delay * 2, MAX_DELAY_S)
        return min(wait, left)

    @property
    def spent(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline


class S3:
    """A boto3 S3 client whose calls run in threads: `await s3.call("put_object", ...)`."""

    def __init__(self, settings: BucketSettings, *, retry_s: float = DEFAULT_RETRY_S) -> None:
        self.settings = settings
        self.retry_s = retry_s
        self.client: Any = boto3.session.Session().client(
            "s3",
            endpoint_url=settings.endpoint_url,
            region_name=settings.region,
            aws_access_key_id=settings.access_key_id.get_secret_value(),
            aws_secret_access_key=settings.secret_access_key.get_secret_value(),
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": settings.addressing_style},
                # One attempt per call: retrying is ours (`Patience`), with a budget of minutes.
                retries={"max_attempts": 1, "mode": "standard"},
                connect_timeout=5,
                read_timeout=60,
                max_pool_connections=16,
            ),
        )

    def patience(self) -> Patience:
        return Patience(self.retry_s)

    async def call(self, operation: str, *, patience: Patience | None = None, **kwargs: Any) -> Any:
        """One S3 operation, retried through an outage (`patience`: the budget it shares)."""
        return await self.attempt(
            _rewinding(getattr(self.client, operation), kwargs), operation, patience
        )

    async def attempt(
        self, blocking: Callable[[], T], what: str, patience: Patience | None = None
    ) -> T:
        """Run `blocking` (an S3 call, maybe with reading its body) in a thread, retried as
        `call` is: a GetObject whose body stops midway is read again from the start."""
        patience = patience or self.patience()
        while True:
            try:
                return await asyncio.to_thread(blocking)
            except S3_FAILURES as exc:
                wait = self._wait_after(exc, what, patience)
                if wait is None:
                    raise
            await asyncio.sleep(wait)

    def call_blocking(
        self, operation: str, *, patience: Patience | None = None, **kwargs: Any
    ) -> Any:
        """`call` for a thread of its own (no event loop): sleeps between tries."""
        patience = patience or self.patience()
        blocking = _rewinding(getattr(self.client, operation), kwargs)
        while True:
            try:
                return blocking()
            except S3_FAILURES as exc:
                wait = self._wait_after(exc, operation, patience)
                if wait is None:
                    raise
            time.sleep(wait)

    async def run(self, blocking: Callable[..., T], *args: Any) -> T:
        """Other blocking work on what a call returned (reading a streamed body)."""
        return await asyncio.to_thread(blocking, *args)

    def _wait_after(self, exc: BaseException, what: str, patience: Patience) -> float | None:
        if not is_transient(exc):
            return None
        wait = patience.next_wait()
        if wait is None and patience.budget_s <= 0:
            return None  # a single try by choice: its caller has its own schedule
        if wait is None:
            log.warning(
                "s3_gave_up",
                operation=what,
                tries=patience.failures,
                budget_s=patience.budget_s,
                error=f"{type(exc).__name__}: {exc}",
            )
            return None
        log.warning(
            "s3_retrying",
            operation=what,
            failures=patience.failures,
            wait_s=round(wait, 2),
            error=f"{type(exc).__name__}: {exc}",
        )
        return wait


def _rewinding(method: Callable[..., T], kwargs: dict[str, Any]) -> Callable[[], T]:
    """`method(**kwargs)`, with a file-like `Body` sent from where it stood on every try: a try
    that failed midway has read part of it (botocore sends a stream from its position)."""
    body: Any = kwargs.get("Body")
    if not (hasattr(body, "seek") and hasattr(body, "tell")):
        return functools.partial(method, **kwargs)
    start = body.tell()

    def from_start() -> T:
        body.seek(start)
        return method(**kwargs)

    return from_start


def error_code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code or str(status or "")
    return type(exc).__name__
