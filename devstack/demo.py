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
import json
import shlex
import sys
from pathlib import Path

from rich.console import Console

from devstack.config import CONFIG_ENV, DEFAULT_CONFIG_PATH, StackFileSettings
from devstack.demo_support import (
    EXAMPLE,
    check_artifacts,
    demo_console,
    print_worker,
    stack_job_client,
    start_demo_stack,
    workflow_link,
)
from devstack.worker_process import ensure_worker
from starter.cli.render import print_summary, stream_progress
from starter.requests import request_from_files
from workflows.contracts import JobState, JobStatus


async def demo(console: Console, config_file: Path) -> JobStatus:
    """`config_file` is absolute: it is what the worker is told to read (DURABLE_COMFY_CONFIG)."""
    started = await start_demo_stack(console, config_file)
    stack = started.running
    worker = await ensure_worker(started.config, started.base_dir, stack.worker_env())
    print_worker(console, worker.pid, worker.log_file)

    async with stack_job_client(stack, started.config.worker.task_queue) as client:
        request = request_from_files(EXAMPLE)
        submitted = await client.submit(request)
        console.print(f"\n[bold]Job[/] {submitted.job_id} submitted ({EXAMPLE})")
        console.print(f"Temporal UI: {workflow_link(stack, submitted.job_id)}\n")
        await stream_progress(client.watch(submitted.job_id), console)
        final = await client.result(submitted.job_id)
    console.print()
    print_summary(final, console, workflow_link(stack, final.job_id))
    await check_artifacts(console, final)
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
        default=None,
        help=f"stack config file (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG_PATH})",
    )
    config: Path | None = parser.parse_args(argv).config
    return config if config is not None else StackFileSettings().config_file


def main() -> None:
    config_file = parse_config_path().expanduser().resolve()
    if not config_file.is_file():
        sys.exit(f"error: config file {config_file} not found")
    console = demo_console()
    final = asyncio.run(demo(console, config_file))
    if final.state != JobState.COMPLETED:
        console.print(json.dumps(final.model_dump(mode="json"), indent=2))
        sys.exit(1)


if __name__ == "__main__":
    main()
