"""Artifact storage on S3 (SeaweedFS locally, AWS or any S3 in production).

One `ArtifactStore` per worker or client process holds one aioboto3 S3 client. Uploads stream with
constant memory (see `protocol.multipart`); every stored object carries its sha256 as user
metadata `sha256`, which `head`, `verify` and `download` check.

Exceptions (workflows.errors'; botocore's are translated at this edge by
`activities.storage_errors.translate`, with `raise ... from exc`):
    StorageError                 base; `.retryable` tells Temporal whether trying again may help
    ├── ObjectMissing            the key does not exist
    ├── IntegrityError           size or sha256 differs from what was written or expected
    ├── StorageConfigError       settings missing/invalid, or credentials/bucket rejected by S3
    └── SourceStreamError        the caller's byte stream raised mid-upload (upload aborted)
Botocore retries at most once (`max_attempts: 2`): Temporal owns retries.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Mapping
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Self

import aioboto3
import structlog
from aiobotocore.config import AioConfig
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict

from activities.s3_multipart import MAX_IN_FLIGHT, AioS3Calls
from activities.storage_errors import S3_FAILURES, translate
from configuration.settings import S3Settings
from protocol import multipart
from protocol.errors import TooManyParts
from protocol.s3_answers import MISSING_CODES, code_of
from workflows.errors import (
    IntegrityError,
    SourceStreamError,
    StorageError,
)

__all__ = [
    "ArtifactStore",
    "DatedBytes",
    "PresignedPut",
    "S3Settings",
    "StoredObject",
]

log = structlog.get_logger("durable_comfy.storage")

MAX_PRESIGN_TTL_S = 7 * 24 * 3600  # SigV4's ceiling
_DOWNLOAD_CHUNK = 1024 * 1024
_METADATA_KEY = re.compile(r"^[a-z0-9-]{1,64}$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class StoredObject(BaseModel):
    model_config = ConfigDict(frozen=True)

    bucket: str
    key: str
    uri: str
    size: int
    sha256: str  # "" when the object carries no sha256 metadata (it then never verifies)
    content_type: str


class DatedBytes(BaseModel):
    """An object's bytes with the S3 server's `Last-Modified` of it and `Date` of the answer."""

    model_config = ConfigDict(frozen=True)

    data: bytes
    last_modified: datetime | None = None
    server_date: str | None = None


class PresignedPut(BaseModel):
    """`presign_put`'s answer: the URL (a bearer credential: never log it), the headers the PUT
    must send as they are (the signature covers each one), and when the URL stops working."""

    model_config = ConfigDict(frozen=True)

    url: str
    headers: dict[str, str]
    expires_at: datetime


class ArtifactStore:
    """Async context manager around one S3 client; all methods raise `StorageError`s."""

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self._stack: AsyncExitStack | None = None
        self._client: Any = None

    async def __aenter__(self) -> Self:
        if self._stack is not None:
            raise RuntimeError("ArtifactStore is already open")
        s = self.settings
        session = aioboto3.Session(
            aws_access_key_id=s.access_key_id.get_secret_value() if s.access_key_id else None,
            aws_secret_access_key=(
                s.secret_access_key.get_secret_value() if s.secret_access_key else None
            ),
            region_name=s.region,
        )
        config = AioConfig(
            signature_version="s3v4",
            s3={"addressing_style": "path"},  # SeaweedFS has no virtual-host buckets
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=32,  # several concurrent uploads x MAX_IN_FLIGHT parts
        )
        stack = AsyncExitStack()
        self._client = await stack.enter_async_context(
            session.client("s3", endpoint_url=s.endpoint_url, config=config)
        )
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    @property
    def client(self) -> Any:
        if self._client is None:
            raise RuntimeError("use ArtifactStore as `async with ArtifactStore(settings)`")
        return self._client

    async def upload_stream(
        self,
        key: str,
        chunks: AsyncIterable[bytes],
        *,
        content_type: str,
        bucket: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> StoredObject:
        """Stream `chunks` to `key`: one PutObject below 8 MiB, else multipart with 8 MiB parts
        and at most 4 in flight. Returns once the stored bytes are confirmed: a PutObject carries
        its sha256 as S3's checksum, which the store checks against what it received and echoes;
        a multipart upload, or a store that does not echo it, is checked with a HEAD (size and
        sha256 metadata)."""
        bucket = bucket or self.settings.bucket
        meta = _check_metadata(metadata or {})
        _check_header_value("content_type", content_type)
        started = time.monotonic()
        source = _guard_source(chunks)
        try:
            done = await multipart.upload_stream(
                AioS3Calls(self.client),
                bucket=bucket,
                key=key,
                chunks=source,
                content_type=content_type,
                max_in_flight=MAX_IN_FLIGHT,
                metadata=meta,
            )
            if done.confirmed:
                return self._uploaded(bucket, key, content_type, done, started)
            stored = await self._head(bucket, key)
        except TooManyParts as exc:
            raise StorageError(str(exc), retryable=False) from exc
        except S3_FAILURES as exc:
            raise translate(exc, "upload", bucket, key) from exc
        finally:
            # Close our wrapper now rather than at garbage collection; the caller's own iterator
            # stays theirs to close.
            await source.aclose()
        if stored is None or stored.size != done.size or stored.sha256 != done.sha256:
            raise IntegrityError(
                f"s3://{bucket}/{key}: stored {stored.size if stored else 'nothing'} bytes / "
                f"sha256 {stored.sha256 if stored else '-'}, streamed {done.size} / {done.sha256}"
            )
        return self._uploaded(bucket, key, stored.content_type, done, started)

    @staticmethod
    def _uploaded(
        bucket: str, key: str, content_type: str, done: multipart.Uploaded, started: float
    ) -> StoredObject:
        elapsed = time.monotonic() - started
        log.info(
            "s3.upload.completed",
            bucket=bucket,
            key=key,
            size=done.size,
            parts=done.parts,
            sha256=done.sha256,
            seconds=round(elapsed, 3),
            mib_per_s=round(done.size / 2**20 / elapsed, 1) if elapsed > 0 else None,
        )
        return StoredObject(
            bucket=bucket,
            key=key,
            uri=f"s3://{bucket}/{key}",
            size=done.size,
            sha256=done.sha256,
            content_type=content_type,
        )

    async def bucket_exists(self) -> bool:
        """False on HeadBucket's 404; any other refusal is a `StorageError`."""
        bucket = self.settings.bucket
        try:
            await self.client.head_bucket(Bucket=bucket)
        except S3_FAILURES as exc:
            if isinstance(exc, ClientError) and code_of(exc) in ("404", "NoSuchBucket"):
                return False
            raise translate(exc, "head-bucket", bucket, "") from exc
        return True

    async def head(self, key: str, *, bucket: str | None = None) -> StoredObject | None:
        bucket = bucket or self.settings.bucket
        try:
            return await self._head(bucket, key)
        except S3_FAILURES as exc:
            raise translate(exc, "head", bucket, key) from exc

    async def verify(self, expected: StoredObject) -> bool:
        """True when the object exists with the stated size and sha256 metadata."""
        actual = await self.head(expected.key, bucket=expected.bucket)
        ok = (
            actual is not None
            and bool(actual.sha256)
            and actual.size == expected.size
            and actual.sha256 == expected.sha256
        )
        if not ok:
            log.warning(
                "s3.verify.mismatch",
                bucket=expected.bucket,
                key=expected.key,
                found=actual is not None,
                size=actual.size if actual else None,
                expected_size=expected.size,
            )
        return ok

    async def presign_get(self, key: str, ttl_s: int, *, bucket: str | None = None) -> str:
        """A GET URL valid for `ttl_s` seconds. It is a bearer credential: never log it."""
        if not 1 <= ttl_s <= MAX_PRESIGN_TTL_S:
            raise ValueError(f"ttl_s must be within 1..{MAX_PRESIGN_TTL_S}")
        bucket = bucket or self.settings.bucket
        try:
            url: str = await self.client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=ttl_s
            )
        except S3_FAILURES as exc:
            raise translate(exc, "presign", bucket, key) from exc
        return url

    async def presign_put(
        self,
        key: str,
        *,
        size: int,
        sha256: str,
        content_type: str,
        ttl_s: int,
        bucket: str | None = None,
    ) -> PresignedPut:
        """A PUT URL for exactly one file, valid for `ttl_s` seconds: the signature covers its
        Content-Length, its Content-Type, its sha256 as `x-amz-checksum-sha256` (so the store
        refuses other bytes with BadDigest and keeps none of them) and as the `sha256` metadata
        that `head` reads. A client that sends anything else, or leaves a header out, is
        refused (SignatureDoesNotMatch): the URL can store that file at that key and nothing
        else. It is a bearer credential all the same: never log it."""
        if not 1 <= ttl_s <= MAX_PRESIGN_TTL_S:
            raise ValueError(f"ttl_s must be within 1..{MAX_PRESIGN_TTL_S}")
        if size < 0:
            raise ValueError("size must not be negative")
        if not _SHA256_HEX.match(sha256):
            raise ValueError("sha256 must be 64 lowercase hex digits")
        _check_header_value("content_type", content_type)
        bucket = bucket or self.settings.bucket
        checksum = base64.b64encode(bytes.fromhex(sha256)).decode()
        # X-Amz-Date has whole seconds: counted from the second before signing, the stated
        # expiry is never later than the store's.
        signed_at = datetime.now(UTC).replace(microsecond=0)
        params = {
            "Bucket": bucket,
            "Key": key,
            "ContentLength": size,
            "ContentType": content_type,
            "ChecksumSHA256": checksum,
            "Metadata": {"sha256": sha256},
        }
        try:
            url: str = await self.client.generate_presigned_url(
                "put_object", Params=params, ExpiresIn=ttl_s
            )
        except S3_FAILURES as exc:
            raise translate(exc, "presign", bucket, key) from exc
        return PresignedPut(
            url=url,
            headers={
                "Content-Type": content_type,
                "Content-Length": str(size),
                "x-amz-checksum-sha256": checksum,
                "x-amz-meta-sha256": sha256,
            },
            expires_at=signed_at + timedelta(seconds=ttl_s),
        )

    async def download(
        self, key: str, dest: Path, *, expected_sha256: str, bucket: str | None = None
    ) -> Path:
        """Stream the object to `dest`, checking its sha256. `dest` appears only when the bytes
        match: they are written to a temporary sibling that is removed on any failure."""
        bucket = bucket or self.settings.bucket
        expected = expected_sha256.lower()
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.part")
        hasher = hashlib.sha256()
        size = 0
        try:
            await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
            resp = await self.client.get_object(Bucket=bucket, Key=key)
            body = resp["Body"]
            out: IO[bytes] = await asyncio.to_thread(tmp.open, "wb")
            try:
                async with body:  # releases the connection however the loop ends
                    async for chunk in body.iter_chunks(_DOWNLOAD_CHUNK):
                        await asyncio.to_thread(_hash_and_write, hasher, out, chunk)
                        size += len(chunk)
            finally:
                await asyncio.to_thread(out.close)
            if hasher.hexdigest() != expected:
                raise IntegrityError(
                    f"s3://{bucket}/{key}: sha256 {hasher.hexdigest()} != expected {expected}"
                )
            await asyncio.to_thread(os.replace, tmp, dest)
        except BaseException as exc:
            # Synchronous on purpose: one unlink is cheap, and it must happen even when a second
            # cancellation arrives.
            tmp.unlink(missing_ok=True)
            if isinstance(exc, S3_FAILURES):
                raise translate(exc, "download", bucket, key) from exc
            raise
        log.info("s3.download.completed", bucket=bucket, key=key, size=size)
        return dest

    async def read_bytes(self, key: str, *, limit: int, bucket: str | None = None) -> bytes:
        """A small object's bytes (an input file), refusing anything larger than `limit`."""
        return (await self.read_dated(key, limit=limit, bucket=bucket)).data

    async def read_dated(self, key: str, *, limit: int, bucket: str | None = None) -> DatedBytes:
        """`read_bytes`, with the object's `Last-Modified` and the answer's `Date`, both the S3
        server's: how old the object is by that clock (what a claim's lease is judged by)."""
        bucket = bucket or self.settings.bucket
        try:
            resp = await self.client.get_object(Bucket=bucket, Key=key)
            if int(resp.get("ContentLength", 0)) > limit:
                resp["Body"].close()
                raise IntegrityError(f"s3://{bucket}/{key} is larger than {limit} bytes")
            async with resp["Body"] as body:
                data: bytes = await body.read()
        except S3_FAILURES as exc:
            raise translate(exc, "get", bucket, key) from exc
        headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
        modified = resp.get("LastModified")
        return DatedBytes(
            data=data,
            last_modified=modified if isinstance(modified, datetime) else None,
            server_date=headers.get("date") if isinstance(headers.get("date"), str) else None,
        )

    async def put_small(
        self, key: str, data: bytes, *, content_type: str, bucket: str | None = None
    ) -> None:
        """One PutObject of a small document (a bookkeeping record, not an artifact: no sha256
        metadata, no read back)."""
        bucket = bucket or self.settings.bucket
        _check_header_value("content_type", content_type)
        try:
            await self.client.put_object(
                Bucket=bucket, Key=key, Body=data, ContentType=content_type
            )
        except S3_FAILURES as exc:
            raise translate(exc, "put", bucket, key) from exc

    async def list_keys(self, prefix: str, *, bucket: str | None = None) -> list[str]:
        """Every key under `prefix`."""
        bucket = bucket or self.settings.bucket
        keys: list[str] = []
        try:
            paginator = self.client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                keys += [item["Key"] for item in page.get("Contents", [])]
        except S3_FAILURES as exc:
            raise translate(exc, "list", bucket, prefix) from exc
        return keys

    async def delete(self, key: str, *, bucket: str | None = None) -> None:
        """Remove `key`; a key that is not there is no error (S3's own rule)."""
        bucket = bucket or self.settings.bucket
        try:
            await self.client.delete_object(Bucket=bucket, Key=key)
        except S3_FAILURES as exc:
            raise translate(exc, "delete", bucket, key) from exc

    async def list_multipart_uploads(self, prefix: str, *, bucket: str | None = None) -> list[str]:
        """Keys with an unfinished multipart upload under `prefix` (a leak detector)."""
        bucket = bucket or self.settings.bucket
        return [key for key, _ in await self._multipart_uploads(bucket, prefix)]

    async def abort_multipart_uploads(self, prefix: str, *, bucket: str | None = None) -> int:
        """Abort every unfinished upload under `prefix`, e.g. one left by a SIGKILLed attempt.

        Only for prefixes no live attempt is writing to. Returns how many were found (abort
        failures are logged, and show up in the next `list_multipart_uploads`)."""
        bucket = bucket or self.settings.bucket
        uploads = await self._multipart_uploads(bucket, prefix)
        for key, upload_id in uploads:
            await multipart.abort_upload(
                AioS3Calls(self.client), bucket=bucket, key=key, upload_id=upload_id
            )
        return len(uploads)

    async def _multipart_uploads(self, bucket: str, prefix: str) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        try:
            paginator = self.client.get_paginator("list_multipart_uploads")
            async for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
        except S3_FAILURES as exc:
            raise translate(exc, "list_multipart_uploads", bucket, prefix) from exc
        return found

    async def _head(self, bucket: str, key: str) -> StoredObject | None:
        try:
            resp = await self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if code_of(exc) in MISSING_CODES:
                return None
            raise
        return StoredObject(
            bucket=bucket,
            key=key,
            uri=f"s3://{bucket}/{key}",
            size=int(resp["ContentLength"]),
            sha256=resp.get("Metadata", {}).get("sha256", ""),
            content_type=resp.get("ContentType") or "application/octet-stream",
        )


async def _guard_source(chunks: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    # Marks failures of the caller's stream so they are not mistaken for S3 failures.
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        raise SourceStreamError(f"source stream failed: {type(exc).__name__}: {exc}") from exc


def _hash_and_write(hasher: Any, out: IO[bytes], chunk: bytes) -> None:
    hasher.update(chunk)
    out.write(chunk)


def _check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    # User metadata travels as HTTP headers: ASCII only, and `sha256` is ours.
    for name, value in metadata.items():
        if not _METADATA_KEY.match(name) or name == "sha256":
            raise ValueError(f"metadata key {name!r} must match [a-z0-9-]+ and not be 'sha256'")
        _check_header_value(name, value)
    return dict(metadata)


def _check_header_value(name: str, value: str) -> None:
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"{name} must be printable ASCII")
