"""`make demo`: the local stack, a worker, and one real job from examples/txt2img.json.

Starts what is not running (Temporal dev server, SeaweedFS, ComfyUI simulator, a worker), submits
the example graph as an attached job, shows its progress, then prints the job ID, the Temporal UI
link and the artifact's presigned URL after checking the downloaded bytes against the sha256.
The stack keeps running afterwards so the job can be looked at; `make down` stops it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from pathlib import Path
from urllib.parse import quote

import httpx
from rich.console import Console

from activities.log_setup import configure_logging
from activities.storage import ArtifactStore, S3Settings
from devstack.config import DEFAULT_CONFIG_PATH, load_stack_config
from devstack.models import RunningStack
from devstack.stack import start_stack
from devstack.worker_process import ensure_worker
from starter.cli.render import print_summary, stream_progress
from starter.client import JobClient
from starter.connection import connect_temporal
from starter.requests import request_from_files
from workflows.contracts import JobState, JobStatus

EXAMPLE = Path("examples/txt2img.json")


def workflow_link(stack: RunningStack, job_id: str) -> str:
    return (
        f"{stack.temporal_ui.rstrip('/')}/namespaces/{quote(stack.namespace)}"
        f"/workflows/{quote(job_id, safe='')}"
    )


async def fetch_and_check(url: str, sha256: str) -> int:
    digest = hashlib.sha256()
    size = 0
    async with httpx.AsyncClient(trust_env=False) as http, http.stream("GET", url) as response:
        response.raise_for_status()
        async for chunk in response.aiter_bytes():
            digest.update(chunk)
            size += len(chunk)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"downloaded bytes do not match sha256 {sha256}")
    return size


async def demo(console: Console) -> JobStatus:
    base_dir = Path.cwd()
    config = load_stack_config(DEFAULT_CONFIG_PATH)
    console.print("[bold]Starting the local stack[/] (Temporal dev server, SeaweedFS, ComfyUI sim)")
    stack = await start_stack(config, base_dir, config_file=DEFAULT_CONFIG_PATH)
    for name, service in stack.services.items():
        console.print(f"  {name:<12} {service.state:<8} {service.url or ''}")
    worker = await ensure_worker(config, base_dir, stack.worker_env())
    console.print(f"  {'worker':<12} running  pid {worker.pid}, log {worker.log_file}")

    s3 = S3Settings.from_env(stack.worker_env())
    temporal = await connect_temporal(stack.temporal_address, stack.namespace)
    async with ArtifactStore(s3) as store:
        client = JobClient(temporal, task_queue=config.worker.task_queue, store=store)
        request = request_from_files(EXAMPLE)
        submitted = await client.submit(request)
        console.print(f"\n[bold]Job[/] {submitted.job_id} submitted ({EXAMPLE})")
        console.print(f"Temporal UI: {workflow_link(stack, submitted.job_id)}\n")
        await stream_progress(client.watch(submitted.job_id), console)
        final = await client.result(submitted.job_id)
    console.print()
    print_summary(final, console, workflow_link(stack, final.job_id))
    for artifact in final.artifacts:
        if artifact.url:
            size = await fetch_and_check(artifact.url, artifact.sha256)
            console.print(f"  presigned URL checked: {size} bytes, sha256 matches")
    console.print(
        "\nThe stack is still running (state in .devstack/). "
        "Stop it with [bold]make down[/] (or `.venv/bin/durable-comfy dev down`)."
    )
    console.print(
        "Try: `. .devstack/env && .venv/bin/durable-comfy status "
        f"{final.job_id}`  or the Temporal UI at {stack.temporal_ui}"
    )
    return final


def main() -> None:
    configure_logging("WARNING")
    console = Console()
    final = asyncio.run(demo(console))
    if final.state != JobState.COMPLETED:
        console.print(json.dumps(final.model_dump(mode="json"), indent=2))
        sys.exit(1)


if __name__ == "__main__":
    main()
