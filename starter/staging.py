"""Inputs too large to travel inside a job's request, staged to S3 by the client.

A job's request is stored in its workflow history, whose payloads Temporal caps (2 MiB by
default), so an inline input is limited to `MAX_INLINE_INPUT_BYTES` (1 MiB). A larger one is
uploaded to the job's output bucket under `{output prefix}/_staged/{sha256}/{filename}` and
travels as an `S3Input`, which the worker reads like any other (and, for RunPod, stages into
the job's `_inputs/` folder for the handler: it never rides in the 10 MB `/run` body).

The key is the content's sha256, so submitting the same file again (a retry, the same job ID,
another job) finds it in place and uploads nothing; an object at that key whose recorded sha256
or size differs is replaced. Staging needs S3 access on the client, configured as the worker's
is (`DURABLE_COMFY_BUCKET`, `DURABLE_COMFY_S3_ENDPOINT`, credentials from `AWS_*` or botocore's
chain); without it an oversized input is refused with what to set (`InputNeedsStaging`).
Nothing here deletes staged objects: give the `_staged/` prefix a lifecycle rule.
"""

from __future__ import annotations

import base64
import hashlib
import mimetypes
import re
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Final, Protocol

import structlog

from starter.errors import InputNeedsStaging
from workflows.contracts import (
    MAX_INLINE_INPUT_BYTES,
    MAX_INLINE_TOTAL_BYTES,
    InlineInput,
    JobRequest,
    S3Input,
)

if TYPE_CHECKING:
    from activities.storage import StoredObject
    from configuration.settings import S3Settings

log = structlog.get_logger("durable_comfy.staging")

STAGING_FOLDER: Final = "_staged"
_PART: Final = 8 * 1024 * 1024
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]")


class StagingStore(Protocol):
    """What staging needs of `activities.storage.ArtifactStore`."""

    @property
    def settings(self) -> S3Settings: ...

    async def head(self, key: str, *, bucket: str | None = None) -> StoredObject | None: ...

    async def upload_stream(
        self,
        key: str,
        chunks: AsyncIterator[bytes],
        *,
        content_type: str,
        bucket: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> StoredObject: ...


def oversized_inputs(request: JobRequest) -> dict[str, int]:
    """The inline inputs to stage, with their sizes in bytes: each one over
    `MAX_INLINE_INPUT_BYTES`, then the largest of the rest until those left inline fit in
    `MAX_INLINE_TOTAL_BYTES` together (several files under the limit can still overflow the
    request's payload)."""
    sizes = {
        name: _decoded_size(ref)
        for name, ref in request.inputs.items()
        if isinstance(ref, InlineInput)
    }
    chosen = {name: size for name, size in sizes.items() if size > MAX_INLINE_INPUT_BYTES}
    left = sorted(
        ((size, name) for name, size in sizes.items() if name not in chosen), reverse=True
    )
    total = sum(size for size, _name in left)
    for size, name in left:
        if total <= MAX_INLINE_TOTAL_BYTES:
            break
        chosen[name] = size
        total -= size
    return chosen


def require_staging(request: JobRequest, *, can_stage: bool) -> None:
    """Raise `InputNeedsStaging` for the first oversized input when nothing can stage it."""
    if can_stage:
        return
    for name, size in oversized_inputs(request).items():
        raise InputNeedsStaging(name, size)


def staged_key(prefix: str, sha256: str, filename: str) -> str:
    safe = _UNSAFE.sub("_", filename.rsplit("/", 1)[-1]).strip("._") or "input"
    return "/".join(part for part in (prefix.strip("/"), STAGING_FOLDER, sha256, safe) if part)


async def stage_inputs(request: JobRequest, store: StagingStore | None) -> JobRequest:
    """The request with every oversized inline input uploaded and replaced by an `S3Input`;
    the request itself when there is none."""
    oversized = oversized_inputs(request)
    if not oversized:
        return request
    require_staging(request, can_stage=store is not None)
    assert store is not None
    bucket = request.output.bucket or store.settings.bucket
    inputs = dict(request.inputs)
    for name in oversized:
        ref = inputs[name]
        assert isinstance(ref, InlineInput)
        inputs[name] = await _stage(store, bucket, request.output.prefix, name, ref)
    return request.model_copy(update={"inputs": inputs})


async def _stage(
    store: StagingStore, bucket: str, prefix: str, name: str, ref: InlineInput
) -> S3Input:
    data = base64.b64decode(ref.data_b64, validate=True)
    digest = hashlib.sha256(data).hexdigest()
    key = staged_key(prefix, digest, ref.filename)
    found = await store.head(key, bucket=bucket)
    uploaded = found is None or found.sha256 != digest or found.size != len(data)
    if uploaded:
        content_type = mimetypes.guess_type(ref.filename)[0] or "application/octet-stream"
        await store.upload_stream(key, _parts(data), content_type=content_type, bucket=bucket)
    log.info("input_staged", input=name, bucket=bucket, key=key, size=len(data), uploaded=uploaded)
    return S3Input(uri=f"s3://{bucket}/{key}")


async def _parts(data: bytes) -> AsyncIterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), _PART):
        yield bytes(view[start : start + _PART])


def _decoded_size(ref: InlineInput) -> int:
    text = ref.data_b64
    return len(text) * 3 // 4 - text[-2:].count("=") if text else 0
