"""Streaming multipart upload with constant memory, for `activities.storage`.

The client-level pieces only: splitting a byte stream into parts, sending parts with bounded
concurrency, aborting an unfinished upload even under cancellation, and stamping metadata that is
known only once the last byte has gone (the sha256) onto the finished object. Errors from botocore
and from the source iterator propagate untouched; `storage` translates them at its edge.

Memory: at most `MAX_IN_FLIGHT` parts exist at once (sending or being filled), each in one
buffer of PART_SIZE, so about MAX_IN_FLIGHT x PART_SIZE plus one source chunk whatever the object
size. A slot is taken before the next part is read, so a fast source never runs ahead of a slow
bucket, and held until its part is both stored and hashed; its buffer is then filled again with a
later part (`PartBuffers`) rather than freed and a new one faulted in.

CPU: the object's sha256 and each part's CRC32 are computed in threads (hashlib and zlib drop the
GIL), the sha256 part after part while later parts are already sending, so the event loop, which
also receives the source stream, is left the network. Bench group 5 (bench/groups/offload.py)
compares this path with a bare multipart upload of the same bytes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import zlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import structlog

PART_SIZE = 8 * 1024 * 1024
MAX_IN_FLIGHT = 4
MAX_PARTS = 10_000  # S3's limit: with 8 MiB parts an object may reach ~78 GiB
# CopyObject refuses sources above 5 GiB; larger objects get their metadata through part copies.
COPY_OBJECT_LIMIT = 5 * 1024**3
COPY_PART_SIZE = 1024**3
ABORT_TIMEOUT_S = 30.0

log = structlog.get_logger("durable_comfy.s3")


class TooManyParts(ValueError):
    """The stream is longer than MAX_PARTS x PART_SIZE."""


@dataclass(frozen=True)
class Uploaded:
    size: int
    sha256: str
    parts: int  # 0 for a single PutObject
    etag: str


class Part(NamedTuple):
    body: io.BytesIO  # positioned at 0, owning its buffer
    size: int


class PartBuffers:
    """Part buffers handed back once their part is stored and hashed, and reused for the next.

    A fresh 8 MiB buffer costs the event loop its page faults and a zero fill before a byte is
    copied into it (bench group 5: about 4 % of the upload process's samples per GiB); a reused
    one costs neither. A buffer is made only when none is free, so no more exist than were ever
    in use at once: MAX_IN_FLIGHT sending plus the one being filled, as without reuse.
    """

    def __init__(self, part_size: int) -> None:
        self.part_size = part_size
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
        if len(self._free) < MAX_IN_FLIGHT:
            self._free.append(body)


async def split_parts(
    chunks: AsyncIterable[bytes | bytearray | memoryview],
    part_size: int,
    buffers: PartBuffers | None = None,
) -> AsyncGenerator[Part, None]:
    """Re-chunk a stream into parts of exactly `part_size` bytes, the last one shorter.

    Always yields at least one part (an empty stream yields an empty one). Each byte is copied
    once, into the part's own BytesIO: botocore turns a `bytes` body into a BytesIO that shares
    the bytes, and aiohttp's `getbuffer()` on it then silently copies the whole part again.
    Once a part is full the next one's buffer comes from `buffers` (a reused one when the
    uploader has handed one back), sized once instead of grown by reallocation; small objects
    never pay for that.
    """
    buffers = buffers or PartBuffers(part_size)
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


async def upload_multipart(
    client: Any,
    *,
    bucket: str,
    key: str,
    first: Part,
    rest: AsyncIterator[Part],
    content_type: str,
    metadata: Mapping[str, str],
    buffers: PartBuffers | None = None,
) -> Uploaded:
    """Upload `first` then every part of `rest`; stamp `sha256` metadata on the finished object.

    Each part's buffer goes back to `buffers` (the one `rest` takes its buffers from) once the
    part is stored and hashed. On any failure or cancellation the multipart upload is aborted
    before the error propagates.
    """
    created = await client.create_multipart_upload(
        Bucket=bucket, Key=key, ContentType=content_type, Metadata=dict(metadata)
    )
    upload_id: str = created["UploadId"]
    try:
        parts, size, digest = await _send_parts(
            client, bucket, key, upload_id, first, rest, buffers
        )
        done = await client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        await abort_upload(client, bucket=bucket, key=key, upload_id=upload_id)
        raise
    etag: str = done["ETag"]
    await stamp_metadata(
        client,
        bucket=bucket,
        key=key,
        etag=etag,
        size=size,
        content_type=content_type,
        metadata={**metadata, "sha256": digest},
    )
    return Uploaded(size=size, sha256=digest, parts=len(parts), etag=etag)


async def _send_parts(
    client: Any,
    bucket: str,
    key: str,
    upload_id: str,
    first: Part,
    rest: AsyncIterator[Part],
    buffers: PartBuffers | None,
) -> tuple[list[dict[str, Any]], int, str]:
    hasher = hashlib.sha256()
    etags: dict[int, str] = {}
    in_flight: set[asyncio.Task[None]] = set()
    size = 0
    hashed = 0  # bytes that went through `hasher`, checked against `size` at the end

    async def send(number: int, body: io.BytesIO) -> None:
        # The CRC32 header botocore would compute itself (request_checksum_calculation
        # "when_supported"), computed here in a thread from the buffer in place: botocore's own
        # reads the part in 1 MiB copies on the event loop, which also receives the download.
        crc = await asyncio.to_thread(crc32_part, body)
        resp = await client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=body,
            ChecksumCRC32=crc,
        )
        etags[number] = resp["ETag"]

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
        # then may the buffer be filled again. A failed part's buffer is never reused.
        try:
            await send(number, part.body)
        except BaseException:
            hashing.cancel()
            raise
        await hashing
        if buffers is not None:
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
            await reap(block=len(in_flight) >= MAX_IN_FLIGHT)
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


def hash_part(hasher: Any, part: Part) -> None:
    with part.body.getbuffer() as view:  # no copy; released before anyone could resize it
        hasher.update(view)


def crc32_part(body: io.BytesIO) -> str:
    """The part's CRC32 as S3's `x-amz-checksum-crc32` wants it (base64 of 4 big-endian bytes),
    botocore's own value, read in place."""
    with body.getbuffer() as view:
        value = zlib.crc32(view) & 0xFFFFFFFF
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


async def stamp_metadata(
    client: Any,
    *,
    bucket: str,
    key: str,
    etag: str,
    size: int,
    content_type: str,
    metadata: Mapping[str, str],
) -> None:
    """Replace the object's metadata by copying it onto itself, server side.

    The sha256 of a streamed object is known only after its last part, but S3 fixes metadata at
    CreateMultipartUpload. `CopySourceIfMatch` pins the copy to the object we just completed, so a
    concurrent writer of the same key can never receive our digest.
    """
    source = {"Bucket": bucket, "Key": key}
    if size <= COPY_OBJECT_LIMIT:
        await client.copy_object(
            Bucket=bucket,
            Key=key,
            CopySource=source,
            CopySourceIfMatch=etag,
            MetadataDirective="REPLACE",
            Metadata=dict(metadata),
            ContentType=content_type,
        )
        return
    created = await client.create_multipart_upload(
        Bucket=bucket, Key=key, ContentType=content_type, Metadata=dict(metadata)
    )
    upload_id: str = created["UploadId"]
    try:
        parts = []
        for number, start in enumerate(range(0, size, COPY_PART_SIZE), start=1):
            end = min(start + COPY_PART_SIZE, size) - 1
            resp = await client.upload_part_copy(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceIfMatch=etag,
                CopySourceRange=f"bytes={start}-{end}",
            )
            parts.append({"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]})
        await client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException:
        await abort_upload(client, bucket=bucket, key=key, upload_id=upload_id)
        raise


async def abort_upload(client: Any, *, bucket: str, key: str, upload_id: str) -> None:
    """Abort a multipart upload. Failures are logged, not raised; a cancellation that arrives
    meanwhile is passed on only once the abort has finished.

    A leaked upload keeps its parts (and their storage cost) until a lifecycle rule removes them,
    so the abort must run to completion before a cancellation is allowed through.
    """
    aborting: Awaitable[Any] = client.abort_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id
    )
    # Bounded: past this, the bucket's AbortIncompleteMultipartUpload lifecycle rule is the net.
    task = asyncio.ensure_future(asyncio.wait_for(aborting, ABORT_TIMEOUT_S))
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
        except Exception:
            break  # reported below from task.exception()
    if task.cancelled():
        log.warning("s3.multipart.abort_cancelled", bucket=bucket, key=key, upload_id=upload_id)
    elif (exc := task.exception()) is not None:
        log.warning(
            "s3.multipart.abort_failed",
            bucket=bucket,
            key=key,
            upload_id=upload_id,
            error=type(exc).__name__,
        )
    else:
        log.info("s3.multipart.aborted", bucket=bucket, key=key, upload_id=upload_id)
    if cancelled:
        raise asyncio.CancelledError
