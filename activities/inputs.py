"""A request's input file as bytes: inline base64 or an s3:// object, with what to fix when
it cannot be read."""

from __future__ import annotations

import base64
import binascii

from activities.errors import fatal, from_storage
from activities.storage import ArtifactStore
from activities.storage_errors import ObjectMissing, StorageError
from workflows.contracts import MAX_INLINE_INPUT_BYTES, InlineInput, InputRef, S3Input
from workflows.shared import ErrorType


async def input_bytes(store: ArtifactStore, name: str, ref: InputRef, *, limit: int) -> bytes:
    if isinstance(ref, InlineInput):
        try:
            data = base64.b64decode(ref.data_b64, validate=True)
        except binascii.Error as exc:
            raise fatal(ErrorType.MISSING_INPUT, f"input {name!r} is not valid base64") from exc
        if len(data) > MAX_INLINE_INPUT_BYTES:
            raise fatal(
                ErrorType.INVALID_REQUEST,
                f"input {name!r} is {len(data)} bytes inline; inline inputs are limited to "
                f"{MAX_INLINE_INPUT_BYTES}: pass an s3:// reference instead",
            )
        return data
    if isinstance(ref, S3Input):
        bucket, _, key = ref.uri.removeprefix("s3://").partition("/")
        try:
            return await store.read_bytes(key, bucket=bucket, limit=limit)
        except ObjectMissing as exc:
            raise fatal(ErrorType.MISSING_INPUT, f"input {name!r}: {exc}") from exc
        except StorageError as exc:
            raise from_storage(exc, f"reading input {name!r}") from exc
    raise fatal(
        ErrorType.INVALID_REQUEST,
        f"input {name!r}: https inputs are not supported yet; upload it and pass s3:// "
        "or inline data",
    )
