"""Streaming one output file into one S3 object with constant memory, its sha256 stamped on the
object as user metadata `sha256` (where `activities.storage` reads it): `protocol.multipart`, the
algorithm the worker runs too, on the handler's client (endpoint/s3.py).

What is the handler's own: at most MAX_IN_FLIGHT parts in memory (its GPU machine's memory is
ComfyUI's); every call rides out a storage outage on the file's one `Patience`, each in a worker
thread, the event loop meanwhile keeping the job's progress and lease going; a cancelled upload
lets the cancellation through before its abort has finished (see `abort_upload`); an upload whose
CreateMultipartUpload had to be tried again has this key's other open uploads aborted; and the
stored object is checked (a HEAD) unless the store confirmed a PutObject's sha256 itself.

A failure that starting over can get past (an outage past the budget's calls, the upload
vanished, a retried copy lost its condition) is an `UploadError` with `again`: the caller streams
the file again, within the same budget.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from endpoint.errors import UploadError
from endpoint.s3 import S3, S3_FAILURES, Patience, error_code, is_transient
from protocol import multipart
from protocol.errors import TooManyParts
from protocol.multipart import PART_SIZE

__all__ = ["MAX_IN_FLIGHT", "PART_SIZE", "Stored", "UploadError", "stream_to_s3"]

log = structlog.get_logger(__name__)

MAX_IN_FLIGHT = 2
# How long an abort of an unfinished upload rides out an outage.
ABORT_BUDGET_S = 30.0

# Answers after which a fresh upload of the same file can succeed: the multipart upload is gone
# (aborted by a lifecycle rule, or completed by a try whose answer was lost), or the copy that
# stamps the digest lost its condition to a retried try of its own.
START_OVER_CODES = frozenset({"NoSuchUpload", "PreconditionFailed", "412"})


@dataclass(frozen=True)
class Stored:
    bucket: str
    key: str
    size: int
    sha256: str
    content_type: str


async def stream_to_s3(
    s3: S3,
    *,
    bucket: str,
    key: str,
    chunks: AsyncIterator[bytes],
    content_type: str,
    patience: Patience | None = None,
) -> Stored:
    """Upload `chunks` to `bucket/key`, then check the stored size and sha256."""
    calls = _Calls(s3, patience or s3.patience())
    try:
        try:
            done = await multipart.upload_stream(
                calls,
                bucket=bucket,
                key=key,
                chunks=chunks,
                content_type=content_type,
                max_in_flight=MAX_IN_FLIGHT,
                cancel_waits_for_abort=False,
            )
        finally:
            if calls.maybe_orphaned:
                await _abort_orphans(s3, bucket, key)
        head = None
        if not done.confirmed:
            head = await s3.call("head_object", patience=calls.patience, Bucket=bucket, Key=key)
    except TooManyParts as exc:
        raise UploadError(f"{key}: {exc}") from exc
    except S3_FAILURES as exc:
        again = is_transient(exc) or error_code(exc) in START_OVER_CODES
        raise UploadError(
            f"storing s3://{bucket}/{key}: {error_code(exc)}: {exc}", again=again
        ) from exc
    if head is not None:
        stored_sha = head.get("Metadata", {}).get("sha256", "")
        if head.get("ContentLength") != done.size or stored_sha != done.sha256:
            raise UploadError(
                f"s3://{bucket}/{key} is stored with {head.get('ContentLength')} bytes / sha256 "
                f"{stored_sha or '-'}, streamed {done.size} / {done.sha256}"
            )
    log.info("artifact_stored", bucket=bucket, key=key, size=done.size, parts=done.parts)
    return Stored(bucket, key, done.size, done.sha256, content_type)


class _Calls:
    """`protocol.multipart.S3Calls` on the handler's client: each call in a thread, tried again
    through an outage on the file's `patience` (`S3.call` sends a part's buffer from its start
    on every try)."""

    def __init__(self, s3: S3, patience: Patience) -> None:
        self.s3 = s3
        self.patience = patience
        # Uploads a retried CreateMultipartUpload may have started without telling us.
        self.maybe_orphaned = False

    async def _call(self, operation: str, **kwargs: Any) -> Any:
        return await self.s3.call(operation, patience=self.patience, **kwargs)

    async def put_object(self, **kwargs: Any) -> Any:
        # A small object's bytes as `bytes`, without a copy (nothing else holds its buffer any
        # more, and it is never reused).
        body = kwargs.pop("Body").getvalue()
        return await self._call("put_object", Body=body, **kwargs)

    async def create_multipart_upload(self, **kwargs: Any) -> Any:
        failures = self.patience.failures
        created = await self._call("create_multipart_upload", **kwargs)
        self.maybe_orphaned |= self.patience.failures > failures
        return created

    async def upload_part(self, **kwargs: Any) -> Any:
        return await self._call("upload_part", **kwargs)

    async def complete_multipart_upload(self, **kwargs: Any) -> Any:
        return await self._call("complete_multipart_upload", **kwargs)

    async def abort_multipart_upload(self, **kwargs: Any) -> Any:
        # Bounded apart: a stopped job waits for it (a leak is a lifecycle rule's job).
        budget = Patience(min(self.patience.budget_s, ABORT_BUDGET_S))
        return await self.s3.call("abort_multipart_upload", patience=budget, **kwargs)

    async def copy_object(self, **kwargs: Any) -> Any:
        return await self._call("copy_object", **kwargs)

    async def upload_part_copy(self, **kwargs: Any) -> Any:
        return await self._call("upload_part_copy", **kwargs)


async def _abort_orphans(s3: S3, bucket: str, key: str) -> None:
    """Abort this key's open uploads: a CreateMultipartUpload whose answer was lost started one
    we never heard of, and its parts would be kept (and billed) for good. Ours has been completed
    or aborted by now. Never raises.

    The worker has no such sweep: its IAM policy leaves out ListBucketMultipartUploads
    (docs/deploy.md), and botocore tries its create at most twice."""
    try:
        listed = await s3.call("list_multipart_uploads", Bucket=bucket, Prefix=key)
        for upload in listed.get("Uploads") or []:
            if upload.get("Key") != key or upload.get("UploadId") is None:
                continue
            await s3.call(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"]
            )
            log.info("multipart_orphan_aborted", key=key, upload_id=upload["UploadId"])
    except S3_FAILURES as exc:
        log.warning("multipart_orphans_not_checked", key=key, error=error_code(exc))
