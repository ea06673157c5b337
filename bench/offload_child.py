"""`python -m bench.offload_child project|raw ...`: one upload of group 5 (offload), in a process
of its own so that its peak RSS is its own (VmHWM, reset right before the upload starts).

- `project`: the worker's code path, `OutputUploader.upload` (activities/comfyui/offload.py):
  GET /view streamed from the simulator into `ArtifactStore.upload_stream` (multipart, sha256);
- `raw`: a plain aioboto3 multipart upload of the same bytes from the local file (8 MiB parts,
  up to 4 in flight: the same part size and concurrency as the project's uploader).

S3 settings come from the environment (the stack's worker_env). Prints one JSON line:
{"seconds", "cpu_seconds", "bytes", "rss_before", "peak_rss", "peak_sampled", "hwm_reset"};
`cpu_seconds` is this process's CPU (all its threads) during the upload: a figure that other work
on the machine disturbs far less than the wall-clock time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from activities.comfyui.offload import OutputUploader
from activities.s3_multipart import MAX_IN_FLIGHT, PART_SIZE
from activities.storage import ArtifactStore, S3Settings
from bench.procs import hwm_bytes, reset_hwm, rss_bytes
from protocol.comfyui.client import ComfyClient
from workflows.contracts import OutputSpec


class PeakSampler:
    """VmRSS every 10 ms from a thread (the event loop may be busy): a second witness of the
    peak, for a kernel that does not let VmHWM be reset."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes("self") or 0)
            self._stop.wait(0.01)


async def project(args: argparse.Namespace, store: ArtifactStore, http: httpx.AsyncClient) -> int:
    uploader = OutputUploader(
        ComfyClient(args.url, http),
        store,
        job_id=f"bench-offload-{uuid.uuid4().hex[:8]}",
        segment=0,
        output=OutputSpec(prefix="bench-offload"),
        stored=[],
        run_tag=args.subfolder,
    )
    item = {"filename": args.filename, "subfolder": args.subfolder, "type": "output"}
    artifact = await uploader.upload("1", item)
    return artifact.size


async def raw(args: argparse.Namespace, store: ArtifactStore) -> int:
    client: Any = store.client
    bucket = store.settings.bucket
    key = f"bench-offload-raw/{uuid.uuid4().hex[:8]}/{Path(args.path).name}"

    async def upload() -> int:
        created = await client.create_multipart_upload(Bucket=bucket, Key=key)
        upload_id = created["UploadId"]
        slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        parts: list[dict[str, Any]] = []
        tasks: list[asyncio.Task[None]] = []

        async def send(number: int, body: bytes) -> None:
            try:
                answer = await client.upload_part(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                )
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
            finally:
                slots.release()

        size = 0
        source = await asyncio.to_thread(Path(args.path).open, "rb")
        try:
            number = 0
            while True:
                await slots.acquire()  # a part is read only once a slot is free
                body = await asyncio.to_thread(source.read, PART_SIZE)
                if not body:
                    slots.release()
                    break
                number += 1
                size += len(body)
                tasks.append(asyncio.create_task(send(number, body)))
        finally:
            source.close()
        await asyncio.gather(*tasks)
        parts.sort(key=lambda p: p["PartNumber"])
        await client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
        return size

    return await upload()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    settings = S3Settings.from_env()
    # Both clients are made and warmed before the timed part, as the worker makes them once at
    # start: an httpx client builds its TLS context (the CA bundle, 30-50 ms) when it is created,
    # which the worker never pays per upload and the raw side does not pay at all.
    async with (
        ArtifactStore(settings) as store,
        httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0), trust_env=False) as http,
    ):
        await store.head("bench-offload/warm-up")  # the client's connection pool is open
        if args.mode == "project":
            # The same for the simulator: a worker's first request (httpcore loads its anyio
            # backend then, ~20 ms) is long past when an output is offloaded.
            (await http.get(f"{args.url}/system_stats")).raise_for_status()
        rss_before = rss_bytes("self")
        hwm_reset = reset_hwm()
        with PeakSampler() as sampler:
            began, cpu_began = time.perf_counter(), time.process_time()
            upload = project(args, store, http) if args.mode == "project" else raw(args, store)
            size = await upload
            seconds = time.perf_counter() - began
            cpu_seconds = time.process_time() - cpu_began
        return {
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,
            "bytes": size,
            "rss_before": rss_before,
            "peak_rss": hwm_bytes("self") if hwm_reset else sampler.peak,
            "peak_sampled": sampler.peak,
            "hwm_reset": hwm_reset,
        }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.offload_child")
    parser.add_argument("mode", choices=("project", "raw"))
    parser.add_argument("--url", help="the simulator (project)")
    parser.add_argument("--filename")
    parser.add_argument("--subfolder", default="")
    parser.add_argument("--path", help="the local file (raw)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))), flush=True)


if __name__ == "__main__":
    main()
