"""Input files the orchestrator staged in S3 (`durable_comfy.inputs`): fetched with the handler's
own bucket credentials, checked, and uploaded to the worker's ComfyUI one at a time, so memory
holds one file at most.

A reference is untrusted input like any other: only keys in the job's own `_inputs/` folder of
the job's bucket are fetched, and a file whose size or sha256 differs from what the orchestrator
recorded is refused rather than run. A fetch rides out a storage outage (endpoint/s3.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import structlog

from endpoint.errors import InputProblem, StagedInputMissing
from endpoint.job_files import JobFiles
from endpoint.s3 import S3, S3_FAILURES
from protocol.comfyui.client import ComfyClient
from protocol.runpod.contract import MAX_INPUT_FILE_BYTES, StagedInput
from protocol.s3_answers import is_missing

log = structlog.get_logger(__name__)

READ_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class StagedInputs:
    """Where a job's staged inputs are and which ones to fetch."""

    s3: S3
    bucket: str
    folder: str
    files: list[StagedInput]

    def check(self) -> None:
        """Refuse references outside the job's own inputs folder before anything is fetched."""
        for index, item in enumerate(self.files):
            inside = item.key.startswith(self.folder + "/") and ".." not in item.key.split("/")
            if not inside:
                raise InputProblem(
                    f"durable_comfy.inputs[{index}] ({item.name!r}): key {item.key!r} is not in "
                    f"this job's inputs folder {self.folder}/"
                )

    async def stage(self, client: ComfyClient, files: JobFiles) -> None:
        """Fetch, check and upload each file (`files` keeps them, for their removal)."""
        self.check()
        for item in self.files:
            data = await self._fetch(item)
            files.uploading(item.name)
            stored = await client.upload_image(item.name, data, overwrite=True)
            files.uploaded(stored)
            log.info("input_staged", name=item.name, stored_as=stored, size=len(data), staged=True)

    async def _fetch(self, item: StagedInput) -> bytes:
        where = f"s3://{self.bucket}/{item.key}"

        def get() -> bytes:
            # Fetched and read in one try: a read cut midway starts again (through an outage).
            resp = self.s3.client.get_object(Bucket=self.bucket, Key=item.key)
            return _read_capped(resp["Body"], item.size)

        try:
            data = await self.s3.attempt(get, "get_object")
        except S3_FAILURES as exc:
            if is_missing(exc):
                raise StagedInputMissing(f"input {item.name!r}: {where} does not exist") from exc
            raise
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != item.size or digest != item.sha256:
            raise InputProblem(
                f"input {item.name!r}: {where} holds {len(data)} bytes / sha256 {digest[:12]}..., "
                f"not the {item.size} / {item.sha256[:12]}... the job names: it changed after "
                "it was staged"
            )
        return data


def _read_capped(body: Any, size: int) -> bytes:
    """Read at most one byte past `size` (and never past MAX_INPUT_FILE_BYTES): a larger object
    is refused by the size check without being read whole."""
    limit = min(size, MAX_INPUT_FILE_BYTES) + 1
    chunks: list[bytes] = []
    got = 0
    try:
        while got < limit:
            chunk = body.read(min(READ_CHUNK, limit - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        body.close()
    return b"".join(chunks)
