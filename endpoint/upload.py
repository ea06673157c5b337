"""Streaming one byte stream into one S3 object with constant memory, its sha256 computed on the
way and stamped on the object as user metadata `sha256` (where `activities.storage` reads it).

Below PART_SIZE: one PutObject. Above: a multipart upload with PART_SIZE parts and at most
MAX_IN_FLIGHT of them sending, so memory stays about (MAX_IN_FLIGHT + 1) x PART_SIZE whatever the
file's size. The event loop, which also reads the file from ComfyUI and keeps the job's progress
and lease going, copies each byte once (a part is joined from the chunks as they came) and
leaves the sha256 to a thread: part after part, in order, while later parts are read and sent.
A part is in flight until it is both stored and hashed. The digest is known only after the last
byte, but S3 fixes metadata when the upload starts, so a finished multipart object is copied onto
itself with the digest, pinned to the object we completed (`CopySourceIfMatch`). Any failure or
cancellation aborts the upload.

Every call rides out a storage outage on the file's one `Patience` (endpoint/s3.py). A failure
that starting over can get past (the upload vanished, a retried copy lost its condition) is an
`UploadError` with `again`: the caller streams the file again, within the same budget.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from endpoint.s3 import S3, S3_FAILURES, Patience, error_code, is_transient

log = structlog.get_logger(__name__)

PART_SIZE = 8 * 1024 * 1024
MAX_IN_FLIGHT = 2
MAX_PARTS = 10_000
# CopyObject refuses sources above 5 GiB; bigger objects get their metadata through part copies.
COPY_OBJECT_LIMIT = 5 * 1024**3
COPY_PART_SIZE = 1024**3
# How long an abort of an unfinished upload rides out an outage.
ABORT_BUDGET_S = 30.0


# Answers after which a fresh upload of the same file can succeed: the multipart upload is gone
# (aborted by a lifecycle rule, or completed by a try whose answer was lost), or the copy that
# stamps the digest lost its condition to a retried try of its own.
START_OVER_CODES = frozenset({"NoSuchUpload", "PreconditionFailed", "412"})


class UploadError(Exception):
    """The object could not be stored, or is not stored as streamed. `again`: streaming the
    file once more may succeed."""

    def __init__(self, message: str, *, again: bool = False) -> None:
        super().__init__(message)
        self.again = again


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
    upload = _Upload(s3, bucket, key, content_type, patience or s3.patience())
    try:
        size, digest = await upload.run(chunks)
        head = await s3.call("head_object", patience=upload.patience, Bucket=bucket, Key=key)
    except S3_FAILURES as exc:
        again = is_transient(exc) or error_code(exc) in START_OVER_CODES
        raise UploadError(
            f"storing s3://{bucket}/{key}: {error_code(exc)}: {exc}", again=again
        ) from exc
    stored_sha = head.get("Metadata", {}).get("sha256", "")
    if head.get("ContentLength") != size or stored_sha != digest:
        raise UploadError(
            f"s3://{bucket}/{key} is stored with {head.get('ContentLength')} bytes / sha256 "
            f"{stored_sha or '-'}, streamed {size} / {digest}"
        )
    log.info("artifact_stored", bucket=bucket, key=key, size=size, parts=upload.parts_sent)
    return Stored(bucket, key, size, digest, content_type)


class _OrderedHash:
    """The object's sha256, fed part after part in threads (hashlib drops the GIL), each part
    after the one before, so the event loop never hashes and the parts never wait on it."""

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()
        self._last: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.hashed = 0

    def add(self, data: bytes) -> asyncio.Task[None]:
        """Hash `data` after everything added before; the task ends once it is hashed."""
        task = asyncio.create_task(self._hash_after(self._last, data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._last = task
        return task

    async def _hash_after(self, previous: asyncio.Task[None] | None, data: bytes) -> None:
        if previous is not None:
            await asyncio.wait([previous])  # cancelling this must not cancel `previous`
            if previous.cancelled() or previous.exception() is not None:
                return  # the digest is never read after a failure (`hexdigest` checks)
        await asyncio.to_thread(self._hasher.update, data)
        self.hashed += len(data)

    def hexdigest(self, size: int) -> str:
        """The digest, once every byte of the `size` streamed went through it."""
        if self.hashed != size:
            raise RuntimeError(f"hashed {self.hashed} of {size} bytes")
        return self._hasher.hexdigest()

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


class _Upload:
    def __init__(
        self, s3: S3, bucket: str, key: str, content_type: str, patience: Patience
    ) -> None:
        self.s3 = s3
        self.bucket = bucket
        self.key = key
        self.content_type = content_type
        self.patience = patience
        self.upload_id: str | None = None
        # Uploads a retried CreateMultipartUpload may have started without telling us.
        self.maybe_orphaned = False
        self.parts: dict[int, str] = {}
        self.parts_sent = 0
        self.in_flight: set[asyncio.Task[None]] = set()

    async def run(self, chunks: AsyncIterator[bytes]) -> tuple[int, str]:
        hasher = _OrderedHash()
        size = 0
        pieces: list[memoryview] = []  # the part being gathered, as the chunks came
        gathered = 0
        try:
            async for chunk in chunks:
                view = memoryview(chunk).cast("B")
                size += view.nbytes
                while view.nbytes:
                    take = min(PART_SIZE - gathered, view.nbytes)
                    pieces.append(view[:take])
                    gathered += take
                    view = view[take:]
                    if gathered == PART_SIZE:
                        part = b"".join(pieces)  # the one copy of these bytes
                        pieces, gathered = [], 0
                        await self._send_part(part, hasher.add(part))
            last = b"".join(pieces)
            pieces = []
            if self.upload_id is None:
                await hasher.add(last)
                digest = hasher.hexdigest(size)
                await self.s3.call(
                    "put_object",
                    patience=self.patience,
                    Bucket=self.bucket,
                    Key=self.key,
                    Body=last,
                    ContentType=self.content_type,
                    Metadata={"sha256": digest},
                )
                return size, digest
            if last:
                await self._send_part(last, hasher.add(last))
            await self._wait_parts(until=0)
            digest = hasher.hexdigest(size)
            etag = await self._complete()
        except BaseException:
            hasher.cancel()
            await self._abort()
            raise
        finally:
            if self.maybe_orphaned:
                await self._abort_orphans()
        await self._stamp(etag, size, digest)
        return size, digest

    async def _send_part(self, body: bytes, hashing: asyncio.Task[None]) -> None:
        if self.upload_id is None:
            failures = self.patience.failures
            created = await self.s3.call(
                "create_multipart_upload",
                patience=self.patience,
                Bucket=self.bucket,
                Key=self.key,
                ContentType=self.content_type,
            )
            self.upload_id = str(created["UploadId"])
            self.maybe_orphaned = self.patience.failures > failures
        self.parts_sent += 1
        number = self.parts_sent
        if number > MAX_PARTS:
            raise UploadError(f"{self.key}: more than {MAX_PARTS} parts of {PART_SIZE} bytes")
        await self._wait_parts(until=MAX_IN_FLIGHT - 1)
        self.in_flight.add(asyncio.create_task(self._put_part(number, body, hashing)))

    async def _put_part(self, number: int, body: bytes, hashing: asyncio.Task[None]) -> None:
        # In flight (and its bytes held) until the part is both stored and hashed.
        resp = await self.s3.call(
            "upload_part",
            patience=self.patience,
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=body,
        )
        self.parts[number] = str(resp["ETag"])
        await hashing

    async def _wait_parts(self, *, until: int) -> None:
        """Wait until at most `until` parts are in flight; a failed part fails the upload."""
        while len(self.in_flight) > until:
            done, _ = await asyncio.wait(self.in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self.in_flight.discard(task)
                task.result()

    async def _complete(self) -> str:
        parts = [{"PartNumber": n, "ETag": self.parts[n]} for n in sorted(self.parts)]
        done = await self.s3.call(
            "complete_multipart_upload",
            patience=self.patience,
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )
        self.upload_id = None  # nothing to abort from here on
        return str(done["ETag"])

    async def _stamp(self, etag: str, size: int, digest: str) -> None:
        source = {"Bucket": self.bucket, "Key": self.key}
        common: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self.key,
            "patience": self.patience,
        }
        if size <= COPY_OBJECT_LIMIT:
            await self.s3.call(
                "copy_object",
                **common,
                CopySource=source,
                CopySourceIfMatch=etag,
                MetadataDirective="REPLACE",
                Metadata={"sha256": digest},
                ContentType=self.content_type,
            )
            return
        created = await self.s3.call(
            "create_multipart_upload",
            **common,
            ContentType=self.content_type,
            Metadata={"sha256": digest},
        )
        upload_id = str(created["UploadId"])
        try:
            parts = []
            for number, start in enumerate(range(0, size, COPY_PART_SIZE), start=1):
                end = min(start + COPY_PART_SIZE, size) - 1
                resp = await self.s3.call(
                    "upload_part_copy",
                    **common,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceIfMatch=etag,
                    CopySourceRange=f"bytes={start}-{end}",
                )
                parts.append({"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]})
            await self.s3.call(
                "complete_multipart_upload",
                **common,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self.upload_id = upload_id
            await self._abort()
            raise

    async def _abort(self) -> None:
        """Abort an unfinished upload; never raises, and runs to its end even when cancelled
        (a leaked upload keeps its parts, and their cost, until a lifecycle rule removes it)."""
        for task in self.in_flight:
            task.cancel()
        self.in_flight.clear()
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is None:
            return
        aborting = asyncio.ensure_future(
            self.s3.call(
                "abort_multipart_upload",
                # Bounded apart: a stopped job waits for it (a leak is a lifecycle rule's job).
                patience=Patience(min(self.patience.budget_s, ABORT_BUDGET_S)),
                Bucket=self.bucket,
                Key=self.key,
                UploadId=upload_id,
            )
        )
        try:
            await asyncio.shield(aborting)
        except asyncio.CancelledError:
            # We are cancelled again: the abort goes on in its thread; say so and pass it on.
            log.warning("multipart_abort_left_running", key=self.key, upload_id=upload_id)
            raise
        except S3_FAILURES as exc:
            log.warning("multipart_abort_failed", key=self.key, error=error_code(exc))
        else:
            log.info("multipart_aborted", key=self.key, upload_id=upload_id)

    async def _abort_orphans(self) -> None:
        """Abort this key's other open uploads: a CreateMultipartUpload whose answer was lost
        started one we never heard of, and its parts would be kept (and billed) for good. Never
        raises."""
        ours = self.upload_id
        try:
            listed = await self.s3.call(
                "list_multipart_uploads", Bucket=self.bucket, Prefix=self.key
            )
            for upload in listed.get("Uploads") or []:
                if upload.get("Key") != self.key or upload.get("UploadId") in (None, ours):
                    continue
                await self.s3.call(
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=upload["UploadId"],
                )
                log.info("multipart_orphan_aborted", key=self.key, upload_id=upload["UploadId"])
        except S3_FAILURES as exc:
            log.warning("multipart_orphans_not_checked", key=self.key, error=error_code(exc))
