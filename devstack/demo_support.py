"""What `make demo` (devstack/demo.py) and `make demo-chaos` (faults/demo.py) share.

Their start-up: logging and a console, the local stack started from a stack file and shown, a
`JobClient` with its artifact store on that stack (built from the stack's own environment with
the product's builders, `S3Settings.from_env` and `connect_temporal`), and their ending: the
Temporal UI link and each artifact fetched through its presigned URL, checked against its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
from rich.console import Console

from activities.log_setup import configure_logging
from activities.storage import ArtifactStore, S3Settings
from devstack.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    StackConfig,
    StackFileSettings,
    load_stack_config,
)
from devstack.models import RunningStack
from devstack.stack import start_stack
from starter.client import JobClient
from starter.codec import codec_from_environ
from starter.connection import connect_temporal
from workflows.contracts import JobStatus

EXAMPLE = Path("examples/txt2img.json")


def demo_console() -> Console:
    """Quiet logs on stderr: the console is the demo's output."""
    configure_logging("WARNING")
    return Console()


@dataclass(frozen=True)
class DemoStack:
    """The running stack and the file it came from."""

    config: StackConfig
    # Absolute: it is what the worker is told to read (DURABLE_COMFY_CONFIG).
    config_file: Path
    # As for `durable-comfy dev up`: relative paths in the file resolve against its directory.
    base_dir: Path
    running: RunningStack


async def start_demo_stack(console: Console, config_file: Path) -> DemoStack:
    """Start what is not running and show each service. `config_file` is absolute."""
    config = load_stack_config(config_file)
    console.print(
        "[bold]Starting the local stack[/] (Temporal dev server, SeaweedFS, ComfyUI sim,"
        f" RunPod sim) from {config_file}",
        soft_wrap=True,
    )
    running = await start_stack(config, config_file.parent, config_file=config_file)
    for name, service in running.services.items():
        note = f"  ({service.note})" if service.note else ""
        console.print(f"  {name:<12} {service.state:<8} {service.url or ''}{note}")
    return DemoStack(config, config_file, config_file.parent, running)


def print_worker(console: Console, pid: int | None, log_file: Path) -> None:
    console.print(f"  {'worker':<12} running  pid {pid}, log {log_file}", soft_wrap=True)


@asynccontextmanager
async def stack_job_client(stack: RunningStack, task_queue: str) -> AsyncIterator[JobClient]:
    """A JobClient on the stack's Temporal with the stack's artifact store (for presigning)."""
    env = stack.worker_env()
    s3 = S3Settings.from_env(env)
    # The stack's payload key too (codec.enabled): the demo must read what its worker wrote.
    temporal = await connect_temporal(
        stack.temporal_address, stack.namespace, codec=codec_from_environ(env)
    )
    async with ArtifactStore(s3) as store:
        yield JobClient(temporal, task_queue=task_queue, store=store)


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


async def check_artifacts(console: Console, final: JobStatus) -> None:
    """Fetch each artifact through its presigned URL; its bytes must match its sha256."""
    for artifact in final.artifacts:
        if artifact.url:
            size = await fetch_and_check(artifact.url, artifact.sha256)
            console.print(f"  presigned URL checked: {size} bytes, sha256 matches")


def parse_config_path(prog: str, description: str, argv: list[str] | None = None) -> Path:
    """The stack file a demo runs on: `--config`, else $DURABLE_COMFY_CONFIG, else the default."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--config",
        "-c",
        type=Path,
        default=None,
        help=f"stack config file (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH})",
    )
    config: Path | None = parser.parse_args(argv).config
    return config if config is not None else StackFileSettings().config_file
