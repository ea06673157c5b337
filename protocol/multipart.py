"""Streaming one byte stream into one S3 object with constant memory, its sha256 computed on the
way and stored on the object as user metadata `sha256`: the one implementation the worker
(`activities/storage.py`, aiobotocore) and the RunPod handler (`endpoint/upload.py`, boto3 in
threads, riding out outages) both run.

The two cannot share a client: their venvs hold botocore versions that cannot live together
(aioboto3 pins one, runpod needs a newer one), and each side retries its own way (botocore once,
then Temporal; the handler through a storage outage on a budget). So each hands in its calls as
`S3Calls` (boto's operation names, keyword arguments and answers), and everything else is here.
Errors from the calls and from the source propagate untouched; each side translates them at its
edge, and `protocol.errors.TooManyParts` too.

Below PART_SIZE: one PutObject carrying its sha256 as S3's checksum, so the store refuses other
bytes (BadDigest) and, by echoing it, confirms what it stored (`Uploaded.confirmed`). Above: a
multipart upload of PART_SIZE parts. The digest is known only after the last byte, but S3 fixes
metadata when the upload starts, so the finished object is copied onto itself with it, pinned to
the object we completed (`CopySourceIfMatch`). Any failure or cancellation aborts the upload
before the error goes on.

Memory: at most `max_in_flight` parts exist at once (sending or being filled), each in one
buffer of PART_SIZE, so about max_in_flight x PART_SIZE plus one source chunk whatever the object
size. A slot is taken before the next part is read, so a fast source never runs ahead of a slow
bucket, and held until its part is both stored and hashed; its buffer is then filled again with a
later part (`PartBuffers`) rather than freed and a new one faulted in.

CPU: each byte is copied once, into its part's buffer; the object's sha256 is computed in
threads (hashlib drops the GIL), part after part, in order, while later parts are already
sending, so the event loop, which also receives the source stream (and on the handler keeps the
job's progress and lease going), is left the network. Bench group 5 (bench/groups/offload.py)
compares the worker's use of it with a bare multipart upload.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import structlog

from protocol.errors import TooManyParts

PART_SIZE = 8 * 1024 * 1024
MAX_PARTS = 10_000  # S3's limit: with 8 MiB parts an object may reach ~78 GiB
# CopyObject refuses sources above 5 GiB; larger objects get their metadata through part copies.
COPY_OBJECT_LIMIT = 5 * 1024**3
COPY_PART_SIZE = 1024**3
# Past this an abort is left to the bucket's AbortIncompleteMultipartUpload lifecycle rule.
ABORT_TIMEOUT_S = 30.0

log = structlog.get_logger(__name__)

# Aborts a cancellation was let past (`cancel_waits_for_abort=False`): held here, as the event
# loop holds tasks only weakly, until they end.
_left_running: set[asyncio.Future[Any]] = set()


class S3Calls(Protocol):
    """The S3 operations of an upload, made as one side's client makes them (its threads, its
    retries), with boto's keyword arguments and answers.

    A part's `Body` is an `io.BytesIO` positioned at 0. Once `upload_part` has returned, the
    buffer is filled with a later part: a call that tries again must send it from 0 again, and
    nothing may keep it. A call that failed or was cancelled may go on reading it (a thread that
    cannot be stopped): its buffer is never reused.
    """

    async def put_object(self, **kwargs: Any) -> Any: ...

    async def create_multipart_upload(self, **kwargs: Any) -> Any: ...

    async def upload_part(self, **kwargs: Any) -> Any: ...

    async def complete_multipart_upload(self, **kwargs: Any) -> Any: ...

    async def abort_multipart_upload(self, **kwargs: Any) -> Any: ...

    async def copy_object(self, **kwargs: Any) -> Any: ...

    async def upload_part_copy(self, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Uploaded:
    size: int
    sha256: str
    parts: int  # 0 for a single PutObject
    etag: str
    # The store checked our sha256 against what it stored (a PutObject's echoed checksum): no
    # HEAD is needed to trust it. A multipart object is never confirmed this way.
    confirmed: bool = False


class Part(NamedTuple):
    body: io.BytesIO  # positioned at 0, owning its buffer
    size: int


class PartBuffers:
    """Part buffers handed back once their part is stored and hashed, and reused for the next.

    A fresh 8 MiB buffer costs the event loop its page faults and a zero fill before a byte is
    copied into it (bench group 5: about 4 % of the upload process's samples per GiB); a reused
    one costs neither. A buffer is made only when none is free, so no more exist than were ever
    in use at once; at most `keep` are held free.
    """

    def __init__(self, part_size: int, keep: int) -> None:
        self.part_size = part_size
        self.keep = keep
        self._free: list[io.BytesIO] = []

    def take(self) -> io.BytesIO:
        """An empty buffer positioned at 0, of capacity `part_size` (reused when one is free)."""
        if self._free:
            body = self._free.pop()
            body.seek(0)
            return body
        return _presized(self.part_size)

    def give_back(self, body: io.BytesIO) -> None:
        """`body`'s part is stored and hashed, and nothing reads it any more."""
        if len(self._free) < self.keep:
            self._free.append(body)


async def split_parts(
    chunks: AsyncIterable[bytes | bytearray | memoryview],
    part_size: int,
    buffers: PartBuffers,
) -> AsyncGenerator[Part, None]:
    """Re-chunk a stream into parts of exactly `part_size` bytes, the last one shorter.

    Always yields at least one part (an empty stream yields an empty one). Each byte is copied
    once, into the part's own BytesIO: botocore turns a `bytes` body into a BytesIO that shares
    the bytes, and aiohttp's `getbuffer()` on it then silently copies the whole part again.
    Once a part is full the next one's buffer comes from `buffers` (a reused one when the
    uploader has handed one back), sized once instead of grown by reallocation; small objects
    never pay for that.
    """
    body, filled, yielded = io.BytesIO(), 0, False
    async for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view.nbytes:
            take = min(part_size - filled, view.nbytes)
            body.write(view[:take])
            filled += take
            view = view[take:]
            if filled == part_size:
                body.seek(0)
                yield Part(body, filled)
                body, filled, yielded = buffers.take(), 0, True
    if filled or not yielded:
        body.truncate(filled)
        body.seek(0)
        yield Part(body, filled)


def _presized(size: int) -> io.BytesIO:
    body = io.BytesIO()
    body.seek(size - 1)
    body.write(b"\0")
    body.seek(0)
    return body


def hash_part(hasher: Any, part: Part) -> None:
    with part.body.getbuffer() as view:  # no copy; released before anyone could resize it
        hasher.update(view)


async def upload_stream(
    s3: S3Calls,
    *,
    bucket: str,
    key: str,
    chunks: AsyncIterable[bytes | bytearray | memoryview],
    content_type: str,
    max_in_flight: int,
    metadata: Mapping[str, str] | None = None,
    cancel_waits_for_abort: bool = True,
) -> Uploaded:
    """Upload `chunks` to `bucket/key` with `metadata` plus `sha256`, at most `max_in_flight`
    parts in memory. `cancel_waits_for_abort`: see `abort_upload`. The caller checks what was
    stored (a HEAD) unless the answer says `confirmed`."""
    meta = dict(metadata or {})
    buffers = PartBuffers(PART_SIZE, max_in_flight)
    parts = split_parts(chunks, PART_SIZE, buffers)
    try:
        first = await anext(parts)
        if first.size < PART_SIZE:
            return await _put(s3, bucket, key, first, content_type, meta)
        return await upload_multipart(
            s3,
            bucket=bucket,
            key=key,
            first=first,
            rest=parts,
            content_type=content_type,
            metadata=meta,
            buffers=buffers,
            max_in_flight=max_in_flight,
            cancel_waits_for_abort=cancel_waits_for_abort,
        )
    finally:
        # Closed now rather than at garbage collection; the caller's stream stays theirs.
        await parts.aclose()


async def _put(
    s3: S3Calls,
    bucket: str,
    key: str,
    part: Part,
    content_type: str,
    metadata: Mapping[str, str],
) -> Uploaded:
    hasher = hashlib.sha256()
    await asyncio.to_thread(hash_part, hasher, part)
    digest = hasher.hexdigest()
    checksum = base64.b64encode(hasher.digest()).decode("ascii")
    resp = await s3.put_object(
        Bucket=bucket,
        Key=key,
        Body=part.body,
        ContentType=content_type,
        Metadata={**metadata, "sha256": digest},
        ChecksumSHA256=checksum,
    )
    # A store that checked the bytes against our sha256 (it refuses the PUT with BadDigest
    # otherwise) says so by echoing it.
    confirmed = resp.get("ChecksumSHA256") == checksum
    return Uploaded(part.size, digest, 0, str(resp.get("ETag", "")), confirmed)


async def upload_multipart(
    s3: S3Calls,
    *,
    bucket: str,
    key: str,
    first: Part,
    rest: AsyncIterator[Part],
    content_type: str,
    metadata: Mapping[str, str],
    buffers: PartBuffers,
    max_in_flight: int,
    cancel_waits_for_abort: bool = True,
) -> Uploaded:
    """Upload `first` then every part of `rest`; stamp `sha256` metadata on the finished object.

    Each part's buffer goes back to `buffers` (the one `rest` takes its buffers from) once the
    part is stored and hashed. On any failure or cancellation the multipart upload is aborted
    before the error propagates.
    """
    created = await s3.create_multipart_upload(
        Bucket=bucket, Key=key, ContentType=content_type, Metadata=dict(metadata)
    )
    upload_id = str(created["UploadId"])
    try:
        parts, size, digest = await _send_parts(
            s3, bucket, key, upload_id, first, rest, buffers, max_in_flight
        )
        done = await s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        await abort_upload(
            s3, bucket=bucket, key=key, upload_id=upload_id, cancel_waits=cancel_waits_for_abort
        )
        raise
    etag = str(done["ETag"])
    await stamp_metadata(
        s3,
        bucket=bucket,
        key=key,
        etag=etag,
        size=size,
        content_type=content_type,
        metadata={**metadata, "sha256": digest},
        cancel_waits_for_abort=cancel_waits_for_abort,
    )
    return Uploaded(size=size, sha256=digest, parts=len(parts), etag=etag)


async def _send_parts(
    s3: S3Calls,
    bucket: str,
    key: str,
    upload_id: str,
    first: Part,
    rest: AsyncIterator[Part],
    buffers: PartBuffers,
    max_in_flight: int,
) -> tuple[list[dict[str, Any]], int, str]:
    hasher = hashlib.sha256()
    etags: dict[int, str] = {}
    in_flight: set[asyncio.Task[None]] = set()
    size = 0
    hashed = 0  # bytes that went through `hasher`, checked against `size` at the end

    async def hash_in_order(previous: asyncio.Task[None] | None, part: Part) -> None:
        # The object's sha256 takes the parts in order, each after the one before, while the
        # parts themselves are already on their way: hashing never holds up the next part's
        # download or its upload. Cancelling this must not cancel `previous` (asyncio.wait).
        nonlocal hashed
        if previous is not None:
            await asyncio.wait([previous])
            if previous.cancelled() or previous.exception() is not None:
                return  # that part's slot failed; its error is the one that surfaces
        await asyncio.to_thread(hash_part, hasher, part)
        hashed += part.size

    async def slot(number: int, part: Part, hashing: asyncio.Task[None]) -> None:
        # A slot (and its part's buffer) is held until the part is both stored and hashed; only
        # then may the buffer be filled again. A failed part's buffer is never reused: a call
        # that failed may still be reading it.
        try:
            resp = await s3.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=part.body
            )
            etags[number] = str(resp["ETag"])
        except BaseException:
            hashing.cancel()
            raise
        await hashing
        buffers.give_back(part.body)

    async def reap(block: bool) -> None:
        # Surfaces a failed part as soon as the loop comes round, instead of after the whole
        # stream has been read.
        if block:
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        done = [t for t in in_flight if t.done()]
        in_flight.difference_update(done)
        # A real failure before the cancellations it caused in later parts' hashing.
        for task in sorted(done, key=lambda t: t.cancelled()):
            task.result()

    try:
        part: Part | None = first
        hashing: asyncio.Task[None] | None = None
        number = 0
        while part is not None:
            number += 1
            if number > MAX_PARTS:
                raise TooManyParts(f"object exceeds {MAX_PARTS} parts of {first.size} bytes")
            size += part.size
            hashing = asyncio.create_task(hash_in_order(hashing, part))
            in_flight.add(asyncio.create_task(slot(number, part, hashing)))
            del part  # the tasks now hold the only references
            await reap(block=len(in_flight) >= max_in_flight)
            part = await anext(rest, None)
        while in_flight:
            await reap(block=True)
    except BaseException:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
        raise
    if hashed != size:  # every slot succeeded, so every part was hashed, in order
        raise RuntimeError(f"hashed {hashed} of {size} bytes")
    parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
    return parts, size, hasher.hexdigest()


async def stamp_metadata(
    s3: S3Calls,
    *,
    bucket: str,
    key: str,
    etag: str,
    size: int,
    content_type: str,
    metadata: Mapping[str, str],
    cancel_waits_for_abort: bool = True,
) -> None:
    """Replace the object's metadata by copying it onto itself, server side.

    `CopySourceIfMatch` pins the copy to the object we just completed, so a concurrent writer of
    the same key can never receive our digest.
    """
    source = {"Bucket": bucket, "Key": key}
    if size <= COPY_OBJECT_LIMIT:
        await s3.copy_object(
            Bucket=bucket,
            Key=key,
            CopySource=source,
            CopySourceIfMatch=etag,
            MetadataDirective="REPLACE",
            Metadata=dict(metadata),
            ContentType=content_type,
        )
        return
    created = await s3.create_multipart_upload(
        Bucket=bucket, Key=key, ContentType=content_type, Metadata=dict(metadata)
    )
    upload_id = str(created["UploadId"])
    try:
        parts = []
        for number, start in enumerate(range(0, size, COPY_PART_SIZE), start=1):
            end = min(start + COPY_PART_SIZE, size) - 1
            resp = await s3.upload_part_copy(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceIfMatch=etag,
                CopySourceRange=f"bytes={start}-{end}",
            )
            parts.append({"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]})
        await s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        await abort_upload(
            s3, bucket=bucket, key=key, upload_id=upload_id, cancel_waits=cancel_waits_for_abort
        )
        raise


async def abort_upload(
    s3: S3Calls, *, bucket: str, key: str, upload_id: str, cancel_waits: bool = True
) -> None:
    """Abort a multipart upload, bounded by ABORT_TIMEOUT_S. Failures are logged, not raised.

    A leaked upload keeps its parts (and their storage cost) until a lifecycle rule removes them,
    so a cancellation that arrives meanwhile is passed on only once the abort has finished
    (`cancel_waits`): the worker's activity ends there, and its process may go with it. The
    handler passes it on at once (`cancel_waits=False`): its stops cancel an upload more than
    once as a matter of course and then wait for it against a lease's deadline, and its event
    loop outlives the job, so the abort still finishes, in the background.
    """
    task = asyncio.ensure_future(
        asyncio.wait_for(
            s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id),
            ABORT_TIMEOUT_S,
        )
    )
    where = {"bucket": bucket, "key": key, "upload_id": upload_id}
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                break  # the abort itself was cancelled (its loop is closing), not us
            if not cancel_waits:
                _left_running.add(task)
                task.add_done_callback(_left_running.discard)
                task.add_done_callback(lambda t: _log_abort(t, where))
                log.warning("multipart_abort_left_running", **where)
                raise
            cancelled = True
        except Exception:
            break  # reported below from task.exception()
    _log_abort(task, where)
    if cancelled:
        raise asyncio.CancelledError


def _log_abort(task: asyncio.Future[Any], where: Mapping[str, str]) -> None:
    if task.cancelled():
        log.warning("multipart_abort_cancelled", **where)
    elif (exc := task.exception()) is not None:
        log.warning("multipart_abort_failed", error=f"{type(exc).__name__}: {exc}", **where)
    else:
        log.info("multipart_aborted", **where)
