"""A prompt's output files as ArtifactRecords: streamed into S3 as each node finishes, or
base64-encoded into the result when no bucket is configured (worker-comfyui's fallback).

`OutputCollector` starts one upload per saved output file the moment an event or the history
names it, each file once, at most MAX_PARALLEL at a time; previews (`type: temp`) are skipped.

Output names are untrusted (any custom node writes them). Files are read through ComfyUI's
`/view`, never opened by name here, and a record whose names could leave the output folder is
refused before it is asked for (`ComfyClient.view` raises `UnsafeOutputName`): the job fails
naming it and keeps what was stored. Keys are built by the job's `key_for`
(`protocol.keys.artifact_key`): inside the job's folder whatever the name.

A finished output stays in ComfyUI's output folder until it is stored: an upload that fails in
a way a fresh start can get past is streamed again from `/view`, within the bucket's retry
budget (BUCKET_RETRY_S), so a storage outage costs time, not the GPU run.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import structlog

from endpoint.errors import OutputTooLarge, UploadError
from endpoint.s3 import DEFAULT_RETRY_S, S3, Patience
from endpoint.upload import stream_to_s3
from protocol.comfyui.client import ComfyClient
from protocol.comfyui.events import output_files
from protocol.errors import UnsafeOutputName
from protocol.keys import content_type_for, in_another_run, shown
from protocol.runpod.contract import ArtifactRecord

log = structlog.get_logger(__name__)

MAX_PARALLEL = 2
# Base64 results travel in RunPod's job-done body, which loses results past ~19 MB (base64):
# beyond this many raw bytes in total the job fails, naming the fix, instead of vanishing.
MAX_BASE64_BYTES = 12 * 1024 * 1024
# Stock clients get a presigned GET URL for S3 outputs, as from worker-comfyui.
PRESIGN_TTL_S = 7 * 24 * 3600


# Opens the output file's byte stream (ComfyUI's /view), once per try.
OpenChunks = Callable[[], AbstractAsyncContextManager[AsyncIterator[bytes]]]


class OutputSink(Protocol):
    def identity(self, node_id: str, item: Mapping[str, str]) -> str:
        """What makes two output items the same stored artifact."""
        ...

    async def store(
        self, node_id: str, item: Mapping[str, str], open_chunks: OpenChunks
    ) -> ArtifactRecord: ...


class S3Sink:
    """Each output streamed to `key_for(node_id, filename)` in `bucket`."""

    def __init__(
        self,
        s3: S3,
        bucket: str,
        key_for: Callable[[str, str], str],
        *,
        presign: bool = False,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._key_for = key_for
        self._presign = presign
        self._retry_s = retry_s

    def identity(self, node_id: str, item: Mapping[str, str]) -> str:
        return self._key_for(node_id, item["filename"])

    async def store(
        self, node_id: str, item: Mapping[str, str], open_chunks: OpenChunks
    ) -> ArtifactRecord:
        key = self.identity(node_id, item)
        content_type = content_type_for(item["filename"])
        # One budget for the whole file, however many tries and calls it takes.
        patience = Patience(self._retry_s)
        while True:
            try:
                async with open_chunks() as chunks:
                    stored = await stream_to_s3(
                        self._s3,
                        bucket=self._bucket,
                        key=key,
                        chunks=chunks,
                        content_type=content_type,
                        patience=patience,
                    )
                break
            except UploadError as exc:
                wait = patience.next_wait() if exc.again else None
                if wait is None:
                    raise
                log.warning("output_store_again", key=key, wait_s=round(wait, 2), error=str(exc))
                await asyncio.sleep(wait)
        data = f"s3://{stored.bucket}/{stored.key}"
        if self._presign:
            data = await self._s3.call(
                "generate_presigned_url",
                ClientMethod="get_object",
                Params={"Bucket": stored.bucket, "Key": stored.key},
                ExpiresIn=PRESIGN_TTL_S,
            )
        return ArtifactRecord(
            filename=item["filename"],
            subfolder=item.get("subfolder", ""),
            type="s3_url",
            data=data,
            node_id=node_id,
            size=stored.size,
            sha256=stored.sha256,
            content_type=content_type,
            bucket=stored.bucket,
            key=stored.key,
        )


class Base64Sink:
    """Each output read whole and returned in the result (no bucket configured)."""

    def __init__(self, max_total_bytes: int = MAX_BASE64_BYTES) -> None:
        self._left = max_total_bytes
        self._limit = max_total_bytes

    def identity(self, node_id: str, item: Mapping[str, str]) -> str:
        return f"{node_id}/{item.get('subfolder', '')}/{item['filename']}"

    async def store(
        self, node_id: str, item: Mapping[str, str], open_chunks: OpenChunks
    ) -> ArtifactRecord:
        body = bytearray()
        async with open_chunks() as chunks:
            async for chunk in chunks:
                body += chunk
                self._left -= len(chunk)
                if self._left < 0:
                    raise OutputTooLarge(
                        f"outputs exceed {self._limit // 2**20} MiB, too much for a base64 "
                        "result: configure a bucket (BUCKET_ENDPOINT_URL, BUCKET_ACCESS_KEY_ID, "
                        "BUCKET_SECRET_ACCESS_KEY) so outputs go to S3"
                    )
        return ArtifactRecord(
            filename=item["filename"],
            subfolder=item.get("subfolder", ""),
            type="base64",
            data=base64.b64encode(body).decode("ascii"),
            node_id=node_id,
            size=len(body),
            sha256=hashlib.sha256(body).hexdigest(),
            content_type=content_type_for(item["filename"]),
        )


OnStored = Callable[[ArtifactRecord], None]


class OutputCollector:
    """Stores every saved output of one prompt once; `records()` in the order they appeared."""

    def __init__(
        self,
        client: ComfyClient,
        sink: OutputSink,
        on_stored: OnStored,
        *,
        run_tag: str = "",
        prior: Iterable[ArtifactRecord] = (),
    ) -> None:
        self._client = client
        self._sink = sink
        self._on_stored = on_stored
        # Outputs an earlier delivery of the submission stored (endpoint/takeover.py): listed
        # again (this worker re-attached to that delivery's prompt), they are not stored twice.
        self._prior = {
            sink.identity(r.node_id, {"filename": r.filename, "subfolder": r.subfolder}): r
            for r in prior
        }
        # The orchestrator's folder for this run (every literal save prefix was rewritten into
        # it); empty for a stock request.
        self._run_tag = run_tag
        self._refused: set[str] = set()
        self._order: list[str] = []
        self._stored: dict[str, ArtifactRecord] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failures: list[BaseException] = []
        self._limit = asyncio.Semaphore(MAX_PARALLEL)
        self._closed = False

    def add(self, outputs: Mapping[str, Any]) -> None:
        """Start storing what `outputs` ({node_id: node output}) names that is new."""
        for node_id, item in output_files(dict(outputs)):
            if item.get("type", "output") != "output":
                continue  # previews are not artifacts
            identity = self._sink.identity(node_id, item)
            if self._closed or identity in self._refused:
                continue
            if identity in self._tasks or identity in self._stored:
                continue
            subfolder = item.get("subfolder", "")
            if self._run_tag and in_another_run(subfolder, self._run_tag):
                # A warm worker keeps earlier jobs' outputs: another run's folder is not ours
                # (maybe another tenant's), and is not read.
                self._failures.append(
                    UnsafeOutputName(
                        item.get("filename", ""),
                        subfolder,
                        item.get("type", "output"),
                        f"in another run's folder, not this run's {shown(self._run_tag)}",
                    )
                )
                self._refused.add(identity)
                continue
            self._order.append(identity)
            if identity in self._prior:
                self._stored[identity] = self._prior[identity]
                self._on_stored(self._prior[identity])
                continue
            self._tasks[identity] = asyncio.create_task(
                self._store(identity, node_id, item), name=f"store {identity}"
            )

    def failure(self) -> BaseException | None:
        """The first upload that failed so far, if any."""
        return self._failures[0] if self._failures else None

    async def drain(self) -> None:
        """Wait for every upload started so far."""
        while pending := [t for t in self._tasks.values() if not t.done()]:
            await asyncio.wait(pending)

    def cancel_now(self) -> None:
        """Stop every upload in flight (each aborts its multipart upload on its way out); no
        record is added from here on."""
        self._closed = True
        for task in self._tasks.values():
            task.cancel()

    async def cancel(self) -> None:
        self.cancel_now()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def records(self) -> list[ArtifactRecord]:
        return [self._stored[i] for i in self._order if i in self._stored]

    async def _store(self, identity: str, node_id: str, item: Mapping[str, str]) -> None:
        def open_chunks() -> AbstractAsyncContextManager[AsyncIterator[bytes]]:
            return self._client.view(
                item["filename"], item.get("subfolder", ""), item.get("type", "output")
            )

        try:
            async with self._limit:
                record = await self._sink.store(node_id, item, open_chunks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("output_not_stored", node_id=node_id, item=dict(item), error=str(exc))
            self._failures.append(exc)
            return
        self._stored[identity] = record
        self._on_stored(record)
