"""The worker's S3 calls for the streamed upload of `protocol.multipart` (the algorithm it shares
with the RunPod handler): aiobotocore's, as `activities.storage` opened them.

Botocore errors propagate untouched; `storage` translates them at its edge. The worker keeps up
to MAX_IN_FLIGHT parts of PART_SIZE in memory (bench group 5 measures it against a bare
multipart upload with the same part size and parts in flight).
"""

from __future__ import annotations

import asyncio
import base64
import io
import zlib
from typing import Any

from protocol.multipart import PART_SIZE

__all__ = ["MAX_IN_FLIGHT", "PART_SIZE", "AioS3Calls", "crc32_part"]

MAX_IN_FLIGHT = 4


class AioS3Calls:
    """`protocol.multipart.S3Calls` on an aiobotocore client. Each call looks the client's
    method up when it is made, as a test that replaces one expects."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def put_object(self, **kwargs: Any) -> Any:
        return await self.client.put_object(**kwargs)

    async def create_multipart_upload(self, **kwargs: Any) -> Any:
        return await self.client.create_multipart_upload(**kwargs)

    async def upload_part(self, **kwargs: Any) -> Any:
        # The CRC32 header botocore would compute itself (request_checksum_calculation
        # "when_supported"), computed here in a thread from the buffer in place: botocore's own
        # reads the part in 1 MiB copies on the event loop, which also receives the download.
        crc = await asyncio.to_thread(crc32_part, kwargs["Body"])
        return await self.client.upload_part(**kwargs, ChecksumCRC32=crc)

    async def complete_multipart_upload(self, **kwargs: Any) -> Any:
        return await self.client.complete_multipart_upload(**kwargs)

    async def abort_multipart_upload(self, **kwargs: Any) -> Any:
        return await self.client.abort_multipart_upload(**kwargs)

    async def copy_object(self, **kwargs: Any) -> Any:
        return await self.client.copy_object(**kwargs)

    async def upload_part_copy(self, **kwargs: Any) -> Any:
        return await self.client.upload_part_copy(**kwargs)


def crc32_part(body: io.BytesIO) -> str:
    """The part's CRC32 as S3's `x-amz-checksum-crc32` wants it (base64 of 4 big-endian bytes),
    botocore's own value, read in place."""
    with body.getbuffer() as view:
        value = zlib.crc32(view) & 0xFFFFFFFF
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")
