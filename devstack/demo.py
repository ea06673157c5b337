"""`make demo`: the local stack, a worker, and one real job from examples/txt2img.json.

Starts what is not running (Temporal dev server, SeaweedFS, ComfyUI simulator, a worker), submits
the example graph as an attached job, shows its progress, then prints the job ID, the Temporal UI
link and the artifact's presigned URL after checking the downloaded bytes against the sha256.
The stack keeps running afterwards so the job can be looked at; `make down` stops it.

`--config PATH` (`make demo CONFIG=PATH`) runs it on another stack file, e.g. a copy of
temporal-dev.yaml with every port moved; without it, $DURABLE_COMFY_CONFIG, else temporal-dev.yaml.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import sys
from pathlib import Path
from urllib.parse import quote

import httpx
from rich.console import Console

from activities.log_setup import configure_logging
from activities.storage import ArtifactStore, S3Settings
from devstack.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, load_stack_config
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


async def demo(console: Console, config_file: Path) -> JobStatus:
    """`config_file` is absolute: it is what the worker is told to read (DURABLE_COMFY_CONFIG)."""
    config = load_stack_config(config_file)
    # As for `durable-comfy dev up`: relative paths in the file resolve against its directory.
    base_dir = config_file.parent
    console.print(
        "[bold]Starting the local stack[/] (Temporal dev server, SeaweedFS, ComfyUI sim)"
        f" from {config_file}"
    )
    stack = await start_stack(config, base_dir, config_file=config_file)
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
    down = f".venv/bin/durable-comfy dev down --config {shlex.quote(str(config_file))}"
    console.print(
        f"\nThe stack is still running (state in {stack.state_dir}). Stop it with `{down}`"
        + (" or [bold]make down[/]." if config_file == DEFAULT_CONFIG_PATH.resolve() else ".")
    )
    console.print(
        f"Try: `. {shlex.quote(str(stack.env_file))} && .venv/bin/durable-comfy status "
        f"{final.job_id}`  or the Temporal UI at {stack.temporal_ui}"
    )
    return final


def parse_config_path(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m devstack.demo", description="Run one example job on the local stack."
    )
    parser.add_argument(
        "--config",
        "-c",
        type=Path,
        default=Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH),
        help=f"stack config file (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH})",
    )
    config: Path = parser.parse_args(argv).config
    return config


def main() -> None:
    config_file = parse_config_path().expanduser().resolve()
    if not config_file.is_file():
        sys.exit(f"error: config file {config_file} not found")
    configure_logging("WARNING")
    console = Console()
    final = asyncio.run(demo(console, config_file))
    if final.state != JobState.COMPLETED:
        console.print(json.dumps(final.model_dump(mode="json"), indent=2))
        sys.exit(1)


if __name__ == "__main__":
    main()
